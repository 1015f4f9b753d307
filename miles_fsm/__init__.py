"""miles-fsm: a guarded, traced memory lifecycle for colocated RL trainers.

    TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED -> TRAINING
"""

# Names resolve lazily (PEP 562): `miles-fsm replay` and other torch-free
# tools import this package without paying for torch.
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncLifecycle": "miles_fsm.aio",
    "AsyncSnapshot": "miles_fsm.aio",
    "BufferRoutingError": "miles_fsm.errors",
    "Collective": "miles_fsm.plan",
    "ConfigError": "miles_fsm.errors",
    "DefinitionError": "miles_fsm.errors",
    "EngineRequestError": "miles_fsm.errors",
    "EngineSessionError": "miles_fsm.errors",
    "EngineUpdateError": "miles_fsm.errors",
    "Failure": "miles_fsm.lifecycle",
    "FaultLocatedError": "miles_fsm.errors",
    "Guard": "miles_fsm.guard",
    "GuardConfig": "miles_fsm.config",
    "GuardError": "miles_fsm.errors",
    "GuardTimeoutError": "miles_fsm.errors",
    "HostCopyMissingError": "miles_fsm.errors",
    "InFlight": "miles_fsm.lifecycle",
    "IneligibleModelError": "miles_fsm.errors",
    "Intent": "miles_fsm.plan",
    "LastSeen": "miles_fsm.errors",
    "Lifecycle": "miles_fsm.lifecycle",
    "LifecycleConfig": "miles_fsm.config",
    "MemoryReleasedError": "miles_fsm.errors",
    "MemoryTagError": "miles_fsm.errors",
    "MilesFsmError": "miles_fsm.errors",
    "MissingDependencyError": "miles_fsm.errors",
    "PeerLostError": "miles_fsm.errors",
    "RankDivergenceError": "miles_fsm.errors",
    "RankFailedError": "miles_fsm.errors",
    "RecoveryError": "miles_fsm.errors",
    "ResumeMemoryError": "miles_fsm.errors",
    "RolloutWindow": "miles_fsm.aio",
    "Side": "miles_fsm.states",
    "Snapshot": "miles_fsm.lifecycle",
    "State": "miles_fsm.states",
    "StateChange": "miles_fsm.aio",
    "StateChanges": "miles_fsm.aio",
    "Step": "miles_fsm.states",
    "StepKind": "miles_fsm.states",
    "StepResult": "miles_fsm.lifecycle",
    "Strategy": "miles_fsm.states",
    "TensorSet": "miles_fsm.plan",
    "TensorSetChangedError": "miles_fsm.errors",
    "TensorSpec": "miles_fsm.plan",
    "TransitionCancelled": "miles_fsm.errors",
    "TransitionNotAllowed": "miles_fsm.errors",
    "TransitionResult": "miles_fsm.lifecycle",
    "Trigger": "miles_fsm.states",
    "VerificationError": "miles_fsm.errors",
    "VerifyConfig": "miles_fsm.config",
    "WeightChecksumError": "miles_fsm.errors",
    "WeightVersionError": "miles_fsm.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from miles_fsm.aio import AsyncLifecycle, AsyncSnapshot, RolloutWindow, StateChange, StateChanges
    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.errors import BufferRoutingError, ConfigError, DefinitionError, EngineRequestError, EngineSessionError, EngineUpdateError, FaultLocatedError, GuardError, GuardTimeoutError, HostCopyMissingError, IneligibleModelError, LastSeen, MemoryReleasedError, MemoryTagError, MilesFsmError, MissingDependencyError, PeerLostError, RankDivergenceError, RankFailedError, RecoveryError, ResumeMemoryError, TensorSetChangedError, TransitionCancelled, TransitionNotAllowed, VerificationError, WeightChecksumError, WeightVersionError
    from miles_fsm.guard import Guard
    from miles_fsm.lifecycle import Failure, InFlight, Lifecycle, Snapshot, StepResult, TransitionResult
    from miles_fsm.plan import Collective, Intent, TensorSet, TensorSpec
    from miles_fsm.states import Side, State, Step, StepKind, Strategy, Trigger


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_fsm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
