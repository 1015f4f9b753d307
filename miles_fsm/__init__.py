"""miles-fsm: a guarded, traced memory lifecycle for colocated RL trainers.

    TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED -> TRAINING
"""

# Names resolve lazily (PEP 562): `miles-fsm replay` and other torch-free
# tools import this package without paying for torch.
from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

__version__ = "0.1.0"

#: What an embedder needs, by the module that defines it, and every name of
#: 0.1.0's top level that a user's code named (docs/architecture.md lists
#: where each of the others went). Everything else imports from its own
#: module: the table's parts from ``miles_fsm.states``, every error from
#: ``miles_fsm.errors`` (whose docstring says where each lives).
_EXPORTS = {
    # The lifecycle, its small frozen configs and what it reports.
    "Lifecycle": "miles_fsm.states.lifecycle",
    "LifecycleConfig": "miles_fsm.config",
    "GuardConfig": "miles_fsm.config",
    "VerifyConfig": "miles_fsm.config",
    "Snapshot": "miles_fsm.states.lifecycle",
    "State": "miles_fsm.states",
    "Trigger": "miles_fsm.states",
    "Strategy": "miles_fsm.states",
    "Guard": "miles_fsm.guard.consensus",
    # The seams: what a driver returns and is handed (a step, its collectives, a tensor set).
    "Step": "miles_fsm.states",
    "StepKind": "miles_fsm.states",
    "Collective": "miles_fsm.plan",
    "TensorSet": "miles_fsm.plan",
    "digest_tensors": "miles_fsm.digest",
    # The seams: implement these for your stack; the reference drivers are the worked example.
    "TrainerDriver": "miles_fsm.states.protocols",
    "EngineDriver": "miles_fsm.states.protocols",
    "VersionedTrainer": "miles_fsm.states.protocols",
    "RematerializingTrainer": "miles_fsm.states.protocols",
    "StepReport": "miles_fsm.states.protocols",
    "ReferenceTrainer": "miles_fsm.drivers.reference.trainer",
    "ReferenceEngine": "miles_fsm.drivers.reference.engine",
    # The async lifecycle.
    "AsyncLifecycle": "miles_fsm.states.aio",
    "AsyncSnapshot": "miles_fsm.aio.machine",
    "RolloutWindow": "miles_fsm.states.aio",
    "StateChange": "miles_fsm.aio.machine",
    # The launchers' entry points.
    "run_ranks": "miles_fsm.launch.local",
    "run_ranks_ray": "miles_fsm.launch.ray_actors",
    "run_under_torchrun": "miles_fsm.launch.torchrun",
    "RankOutcome": "miles_fsm.launch.local",
    # The errors a caller catches at the top.
    "MilesFsmError": "miles_fsm.errors",
    "ConfigError": "miles_fsm.errors",
    "DriverProtocolError": "miles_fsm.states.errors",
    "TransitionNotAllowed": "miles_fsm.errors",
    "GuardError": "miles_fsm.errors",
    "LastSeen": "miles_fsm.errors",
    "MemoryReleasedError": "miles_fsm.errors",
    "IneligibleModelError": "miles_fsm.drivers.errors",
    "RankFailedError": "miles_fsm.errors",
    "RecoveryError": "miles_fsm.states.errors",
    "VerificationError": "miles_fsm.states.errors",
    "LauncherLostError": "miles_fsm.launch.local",
    "RankSignalledError": "miles_fsm.launch.local",
    "RankStoppedError": "miles_fsm.launch.local",
}

__all__ = [
    "AsyncLifecycle",
    "AsyncSnapshot",
    "Collective",
    "ConfigError",
    "DriverProtocolError",
    "EngineDriver",
    "Guard",
    "GuardConfig",
    "GuardError",
    "IneligibleModelError",
    "LastSeen",
    "LauncherLostError",
    "Lifecycle",
    "LifecycleConfig",
    "MemoryReleasedError",
    "MilesFsmError",
    "RankFailedError",
    "RankOutcome",
    "RankSignalledError",
    "RankStoppedError",
    "RecoveryError",
    "RematerializingTrainer",
    "ReferenceEngine",
    "ReferenceTrainer",
    "RolloutWindow",
    "Snapshot",
    "State",
    "StateChange",
    "Step",
    "StepKind",
    "StepReport",
    "Strategy",
    "TensorSet",
    "TrainerDriver",
    "TransitionNotAllowed",
    "Trigger",
    "VerificationError",
    "VerifyConfig",
    "VersionedTrainer",
    "__version__",
    "digest_tensors",
    "run_ranks",
    "run_ranks_ray",
    "run_under_torchrun",
]

if TYPE_CHECKING:
    from miles_fsm.aio.machine import AsyncSnapshot, StateChange
    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.errors import IneligibleModelError
    from miles_fsm.drivers.reference.engine import ReferenceEngine
    from miles_fsm.drivers.reference.trainer import ReferenceTrainer
    from miles_fsm.errors import (
        ConfigError,
        GuardError,
        LastSeen,
        MemoryReleasedError,
        MilesFsmError,
        RankFailedError,
        TransitionNotAllowed,
    )
    from miles_fsm.guard.consensus import Guard
    from miles_fsm.launch.local import LauncherLostError, RankOutcome, RankSignalledError, RankStoppedError, run_ranks
    from miles_fsm.launch.ray_actors import run_ranks_ray
    from miles_fsm.launch.torchrun import run_under_torchrun
    from miles_fsm.plan import Collective, TensorSet
    from miles_fsm.states import State, Step, StepKind, Strategy, Trigger
    from miles_fsm.states.aio import AsyncLifecycle, RolloutWindow
    from miles_fsm.states.errors import DriverProtocolError, RecoveryError, VerificationError
    from miles_fsm.states.lifecycle import Lifecycle, Snapshot
    from miles_fsm.states.protocols import (
        EngineDriver,
        RematerializingTrainer,
        StepReport,
        TrainerDriver,
        VersionedTrainer,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
