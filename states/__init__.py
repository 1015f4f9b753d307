"""The colocated lifecycle: its table, its rules, its actions and the driver protocols.

Built on the engine (``miles_fsm``); the drivers (``miles_fsm.drivers``)
implement its protocols. Importing this package is light: ``Lifecycle``
and the protocols resolve on first use, so the table is available to tools
that never touch torch.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports
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
    "RematerializingTrainer": "miles_fsm.states.protocols",
    "StepReport": "miles_fsm.states.protocols",
    "TrainerDriver": "miles_fsm.states.protocols",
    "VersionedTrainer": "miles_fsm.states.protocols",
}

# The table's names (imported above) and the lazy ones; tests/test_public_api.py checks that this
# list is exactly those, so it cannot drift from them.
__all__ = [
    "AsyncLifecycle",
    "CYCLE",
    "DEFINITION",
    "Definition",
    "ENGINE_TAGS",
    "EngineDriver",
    "Lifecycle",
    "MemoryLedger",
    "RematerializingTrainer",
    "RolloutWindow",
    "Side",
    "Snapshot",
    "State",
    "Step",
    "StepKind",
    "StepReport",
    "Strategy",
    "TRAINER_TAGS",
    "TrainerDriver",
    "Transition",
    "Trigger",
    "VersionedTrainer",
    "lifecycle_definition",
    "steps_for",
]

if TYPE_CHECKING:
    from miles_fsm.states.aio import AsyncLifecycle, RolloutWindow
    from miles_fsm.states.lifecycle import Lifecycle, Snapshot
    from miles_fsm.states.memory import MemoryLedger
    from miles_fsm.states.protocols import (
        EngineDriver,
        RematerializingTrainer,
        StepReport,
        TrainerDriver,
        VersionedTrainer,
    )

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
