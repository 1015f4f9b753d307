"""The colocated lifecycle: its table, its rules, its actions and the driver protocols.

Built on the engine (``miles_fsm``); the drivers (``miles_fsm.drivers``)
implement its protocols. Importing this package is light: ``Lifecycle``
and the protocols resolve on first use, so the table is available to tools
that never touch torch.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

from miles_fsm.states import definition as _definition
from miles_fsm.states.definition import (
    CYCLE,
    DEFINITION,
    ENGINE_TAGS,
    TRAINER_TAGS,
    Definition,
    Side,
    State,
    Step,
    StepKind,
    Strategy,
    Transition,
    Trigger,
    lifecycle_definition,
    steps_for,
)

_LAZY = {
    "AsyncLifecycle": "miles_fsm.states.aio",
    "EngineDriver": "miles_fsm.states.protocols",
    "Lifecycle": "miles_fsm.states.lifecycle",
    "MemoryLedger": "miles_fsm.states.memory",
    "RolloutWindow": "miles_fsm.states.aio",
    "Snapshot": "miles_fsm.states.lifecycle",
    "StepReport": "miles_fsm.states.protocols",
    "TrainerDriver": "miles_fsm.states.protocols",
    "VersionedTrainer": "miles_fsm.states.protocols",
}

__all__ = sorted([*_definition.__all__, *_LAZY])

if TYPE_CHECKING:
    from miles_fsm.states.aio import AsyncLifecycle, RolloutWindow
    from miles_fsm.states.lifecycle import Lifecycle, Snapshot
    from miles_fsm.states.memory import MemoryLedger
    from miles_fsm.states.protocols import EngineDriver, StepReport, TrainerDriver, VersionedTrainer

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
