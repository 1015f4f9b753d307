"""The colocated lifecycle: ``TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED``."""

from miles_fsm.states.definition import (
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
)

__all__ = [
    "DEFINITION",
    "ENGINE_TAGS",
    "TRAINER_TAGS",
    "Definition",
    "Side",
    "State",
    "Step",
    "StepKind",
    "Strategy",
    "Transition",
    "Trigger",
]
