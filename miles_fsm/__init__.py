"""miles-fsm: a guarded, traced memory lifecycle for colocated RL trainers.

    TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED -> TRAINING
"""

# Names resolve lazily (PEP 562): `miles-fsm replay` and other torch-free
# tools import this package without paying for torch.
from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncLifecycle": "miles_fsm.states.aio",
    "AsyncMachine": "miles_fsm.aio.machine",
    "AsyncSnapshot": "miles_fsm.aio.machine",
    "BufferRoutingError": "miles_fsm.drivers.errors",
    "CYCLE": "miles_fsm.states",
    "Collective": "miles_fsm.plan",
    "ConfigError": "miles_fsm.errors",
    "DEFINITION": "miles_fsm.states",
    "Definition": "miles_fsm.definition",
    "CudaAvailableError": "miles_fsm.drivers.errors",
    "DIGEST_SCHEME": "miles_fsm.digest",
    "DefinitionError": "miles_fsm.errors",
    "DriverProtocolError": "miles_fsm.states.errors",
    "EngineDriver": "miles_fsm.states.protocols",
    "EngineRequestError": "miles_fsm.drivers.errors",
    "EngineSessionError": "miles_fsm.drivers.errors",
    "EngineUpdateError": "miles_fsm.drivers.errors",
    "Failure": "miles_fsm.machine",
    "FaultLocatedError": "miles_fsm.apps.errors",
    "FlightRecorderError": "miles_fsm.flight_recorder",
    "Guard": "miles_fsm.guard.consensus",
    "GuardConfig": "miles_fsm.config",
    "GuardError": "miles_fsm.errors",
    "GuardTimeoutError": "miles_fsm.errors",
    "HostCopyMissingError": "miles_fsm.drivers.errors",
    "InFlight": "miles_fsm.machine",
    "IneligibleModelError": "miles_fsm.drivers.errors",
    "Intent": "miles_fsm.plan",
    "LastSeen": "miles_fsm.errors",
    "LauncherLostError": "miles_fsm.launch.local",
    "RankStoppedError": "miles_fsm.launch.local",
    "Lifecycle": "miles_fsm.states.lifecycle",
    "LifecycleConfig": "miles_fsm.config",
    "Machine": "miles_fsm.machine",
    "MemoryLedger": "miles_fsm.states.memory",
    "MemoryReleasedError": "miles_fsm.errors",
    "MemoryTagError": "miles_fsm.states.errors",
    "MilesFsmError": "miles_fsm.errors",
    "MissingDependencyError": "miles_fsm.drivers.errors",
    "PeerFailedError": "miles_fsm.errors",
    "PeerLostError": "miles_fsm.errors",
    "PeerNeverJoinedError": "miles_fsm.errors",
    "PeerStepFailedError": "miles_fsm.errors",
    "ProcessGroupMissingError": "miles_fsm.errors",
    "Plan": "miles_fsm.machine",
    "PlannedStep": "miles_fsm.machine",
    "RankDivergenceError": "miles_fsm.errors",
    "RankFailedError": "miles_fsm.errors",
    "RankRaisedError": "miles_fsm.errors",
    "RecoveryError": "miles_fsm.states.errors",
    "ResumeMemoryError": "miles_fsm.drivers.errors",
    "RolloutWindow": "miles_fsm.states.aio",
    "Side": "miles_fsm.states",
    "Snapshot": "miles_fsm.states.lifecycle",
    "State": "miles_fsm.states",
    "StateChange": "miles_fsm.aio.machine",
    "StateChanges": "miles_fsm.aio.machine",
    "Step": "miles_fsm.states",
    "StepKind": "miles_fsm.states",
    "StepReport": "miles_fsm.states.protocols",
    "StepResult": "miles_fsm.machine",
    "Strategy": "miles_fsm.states",
    "StructureVersionError": "miles_fsm.states.errors",
    "TensorSet": "miles_fsm.plan",
    "TensorSetChangedError": "miles_fsm.states.errors",
    "UndeclaredCollectiveError": "miles_fsm.states.errors",
    "UnsupportedVersionError": "miles_fsm.drivers.errors",
    "TensorSpec": "miles_fsm.plan",
    "TrainerDriver": "miles_fsm.states.protocols",
    "VersionedTrainer": "miles_fsm.states.protocols",
    "Transition": "miles_fsm.definition",
    "TransitionCancelled": "miles_fsm.errors",
    "TransitionNotAllowed": "miles_fsm.errors",
    "TransitionResult": "miles_fsm.machine",
    "Trigger": "miles_fsm.states",
    "VerificationError": "miles_fsm.states.errors",
    "VerifyConfig": "miles_fsm.config",
    "WeightChecksumError": "miles_fsm.drivers.errors",
    "digest_tensors": "miles_fsm.digest",
    "WeightVersionError": "miles_fsm.states.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from miles_fsm.aio.machine import (  # noqa: F401
        AsyncMachine,
        AsyncSnapshot,
        StateChange,
        StateChanges,
    )
    from miles_fsm.apps.errors import (  # noqa: F401
        FaultLocatedError,
    )
    from miles_fsm.config import (  # noqa: F401
        GuardConfig,
        LifecycleConfig,
        VerifyConfig,
    )
    from miles_fsm.definition import (  # noqa: F401
        Definition,
        Transition,
    )
    from miles_fsm.digest import (  # noqa: F401
        DIGEST_SCHEME,
        digest_tensors,
    )
    from miles_fsm.drivers.errors import (  # noqa: F401
        BufferRoutingError,
        CudaAvailableError,
        EngineRequestError,
        EngineSessionError,
        EngineUpdateError,
        HostCopyMissingError,
        IneligibleModelError,
        MissingDependencyError,
        ResumeMemoryError,
        UnsupportedVersionError,
        WeightChecksumError,
    )
    from miles_fsm.errors import (  # noqa: F401
        ConfigError,
        DefinitionError,
        GuardError,
        GuardTimeoutError,
        LastSeen,
        MemoryReleasedError,
        MilesFsmError,
        PeerFailedError,
        PeerLostError,
        PeerNeverJoinedError,
        PeerStepFailedError,
        ProcessGroupMissingError,
        RankDivergenceError,
        RankFailedError,
        RankRaisedError,
        TransitionCancelled,
        TransitionNotAllowed,
    )
    from miles_fsm.guard.consensus import (  # noqa: F401
        Guard,
    )
    from miles_fsm.launch.local import (  # noqa: F401
        LauncherLostError,
        RankStoppedError,
    )
    from miles_fsm.flight_recorder import FlightRecorderError  # noqa: F401
    from miles_fsm.machine import (  # noqa: F401
        Failure,
        InFlight,
        Machine,
        Plan,
        PlannedStep,
        StepResult,
        TransitionResult,
    )
    from miles_fsm.plan import (  # noqa: F401
        Collective,
        Intent,
        TensorSet,
        TensorSpec,
    )
    from miles_fsm.states import (  # noqa: F401
        CYCLE,
        DEFINITION,
        Side,
        State,
        Step,
        StepKind,
        Strategy,
        Trigger,
    )
    from miles_fsm.states.aio import (  # noqa: F401
        AsyncLifecycle,
        RolloutWindow,
    )
    from miles_fsm.states.errors import (  # noqa: F401
        DriverProtocolError,
        MemoryTagError,
        RecoveryError,
        StructureVersionError,
        UndeclaredCollectiveError,
        TensorSetChangedError,
        VerificationError,
        WeightVersionError,
    )
    from miles_fsm.states.lifecycle import (  # noqa: F401
        Lifecycle,
        Snapshot,
    )
    from miles_fsm.states.memory import (  # noqa: F401
        MemoryLedger,
    )
    from miles_fsm.states.protocols import (  # noqa: F401
        EngineDriver,
        StepReport,
        TrainerDriver,
        VersionedTrainer,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
