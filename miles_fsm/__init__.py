"""miles-fsm: a guarded, traced memory lifecycle for colocated RL trainers.

    TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED -> TRAINING
"""

from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
from miles_fsm.errors import (
    ConfigError,
    DefinitionError,
    EngineRequestError,
    EngineSessionError,
    GuardError,
    GuardTimeoutError,
    IneligibleModelError,
    MemoryTagError,
    MilesFsmError,
    PeerLostError,
    RankDivergenceError,
    RecoveryError,
    TensorSetChangedError,
    TransitionCancelled,
    TransitionNotAllowed,
    VerificationError,
    WeightVersionError,
)
from miles_fsm.guard import Guard
from miles_fsm.lifecycle import Failure, InFlight, Lifecycle, Snapshot, StepResult, TransitionResult
from miles_fsm.plan import Collective, Intent, TensorSet, TensorSpec
from miles_fsm.states import Side, State, Step, StepKind, Strategy, Trigger

__version__ = "0.1.0"

__all__ = [
    "Collective",
    "ConfigError",
    "DefinitionError",
    "EngineRequestError",
    "EngineSessionError",
    "Failure",
    "Guard",
    "GuardConfig",
    "GuardError",
    "GuardTimeoutError",
    "InFlight",
    "IneligibleModelError",
    "Intent",
    "Lifecycle",
    "LifecycleConfig",
    "MemoryTagError",
    "MilesFsmError",
    "PeerLostError",
    "RankDivergenceError",
    "RecoveryError",
    "Side",
    "Snapshot",
    "State",
    "Step",
    "StepKind",
    "StepResult",
    "Strategy",
    "TensorSet",
    "TensorSetChangedError",
    "TensorSpec",
    "TransitionCancelled",
    "TransitionNotAllowed",
    "TransitionResult",
    "Trigger",
    "VerificationError",
    "VerifyConfig",
    "WeightVersionError",
    "__version__",
]
