"""The colocated lifecycle: states, triggers, steps and the transition table.

This module is pure data, built on the engine's ``Definition``. ``Lifecycle``
(``miles_fsm.states.lifecycle``) executes it; the
diagram in ``docs/lifecycle.md`` is generated from it; ``miles-fsm replay``
re-drives it offline. Nothing here touches a tensor or a process group.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from miles_fsm.definition import Definition, Transition

__all__ = [
    "CYCLE",
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
    "lifecycle_definition",
    "steps_for",
]


class Strategy(str, enum.Enum):
    """How the actor's bf16 params come back after the engine had the GPU."""

    #: No host copy of the bf16 params: cast them from the fp32 master shard,
    #: then all-gather. Only the extras (fp32 params, buffers) are backed up.
    REMATERIALIZE = "rematerialize"
    #: A full host copy of every tensor, restored as is.
    BACKUP = "backup"


class Side(str, enum.Enum):
    """Whose memory a step moves."""

    TRAINER = "trainer"
    ENGINE = "engine"


class State(str, enum.Enum):
    """Where one trainer rank is in its memory lifecycle."""

    INITIAL = "INITIAL"
    TRAINING = "TRAINING"
    OFFLOADED = "OFFLOADED"
    PAUSED = "PAUSED"
    REMATERIALIZED = "REMATERIALIZED"
    SYNCED = "SYNCED"
    FAILED = "FAILED"

    @property
    def trainer_paused_tags(self) -> frozenset[str]:
        """Trainer memory tags that are released in this state."""
        return _TRAINER_PAUSED[self]

    @property
    def engine_released_tags(self) -> frozenset[str]:
        """Engine memory tags that are released in this state."""
        return _ENGINE_RELEASED[self]

    @property
    def trainer_resident(self) -> bool:
        """True when every trainer tag is on the device (training may run)."""
        return self is not State.FAILED and not self.trainer_paused_tags

    @property
    def engine_can_generate(self) -> bool:
        """True when the engine holds its weights and KV cache."""
        return self is not State.FAILED and not self.engine_released_tags

    @property
    def in_cycle(self) -> bool:
        """True for the five states of the offload/wake cycle."""
        return self not in (State.INITIAL, State.FAILED)


class Trigger(str, enum.Enum):
    """One trigger per arrow of the cycle."""

    START = "start"
    OFFLOAD = "offload"
    PAUSE = "pause"
    REMATERIALIZE = "rematerialize"
    SYNC = "sync"
    RESUME = "resume"


class StepKind(str, enum.Enum):
    """An action; each maps to exactly one driver protocol method."""

    BACKUP = "backup"
    RECORD_DIGESTS = "record_digests"
    PAUSE_MEMORY = "pause_memory"
    RESUME_MEMORY = "resume_memory"
    PUSH_WEIGHTS = "push_weights"
    CAST_MAIN_TO_PARAMS = "cast_main_to_params"
    RESTORE = "restore"
    PARAM_SYNC = "param_sync"
    VERIFY = "verify"


@dataclass(frozen=True, slots=True)
class Step:
    """One action of a transition.

    ``only`` restricts a step to one weight strategy; ``tags`` are memory
    tags for pause/resume and weight tags for backup/restore.
    """

    kind: StepKind
    side: Side = Side.TRAINER
    tags: tuple[str, ...] = ()
    only: Strategy | None = None

    def applies_to(self, strategy: Strategy) -> bool:
        return self.only is None or self.only is strategy

    def __str__(self) -> str:
        tags = f"({','.join(self.tags)})" if self.tags else ""
        if self.side is Side.TRAINER:
            return f"{self.kind.value}{tags}"
        # SGLang's word for it: engines release memory, trainers pause it.
        verb = "release_memory" if self.kind is StepKind.PAUSE_MEMORY else self.kind.value
        return f"{self.side.value}.{verb}{tags}"


def steps_for(transition: Transition[State, Trigger], strategy: Strategy) -> tuple[Step, ...]:
    """The steps a transition runs under ``strategy``, in table order."""
    return tuple(s for s in transition.steps if s.applies_to(strategy))


#: The trainer's memory tags, as torch_memory_saver names its regions.
TRAINER_TAGS = ("param_buffer", "grad_buffer", "default")
#: The engine's memory tags, as SGLang names them.
ENGINE_TAGS = ("weights", "kv_cache")

_T = frozenset
_TRAINER_PAUSED: Mapping[State, frozenset[str]] = MappingProxyType(
    {
        State.INITIAL: _T(),
        State.TRAINING: _T(),
        State.OFFLOADED: _T({"grad_buffer", "default"}),
        State.PAUSED: _T(TRAINER_TAGS),
        State.REMATERIALIZED: _T(),
        State.SYNCED: _T(),
        State.FAILED: _T(),
    }
)
_ENGINE_RELEASED: Mapping[State, frozenset[str]] = MappingProxyType(
    {
        State.INITIAL: _T(),
        State.TRAINING: _T(ENGINE_TAGS),
        State.OFFLOADED: _T(ENGINE_TAGS),
        State.PAUSED: _T(),
        State.REMATERIALIZED: _T(ENGINE_TAGS),
        State.SYNCED: _T(ENGINE_TAGS),
        State.FAILED: _T(),
    }
)

_K = StepKind
_E = Side.ENGINE
_RM = Strategy.REMATERIALIZE

_TRANSITIONS = (
    Transition(
        Trigger.START,
        State.INITIAL,
        State.TRAINING,
        (
            Step(_K.BACKUP, tags=("ref",)),
            Step(_K.PAUSE_MEMORY, _E, ENGINE_TAGS),
        ),
    ),
    Transition(
        Trigger.OFFLOAD,
        State.TRAINING,
        State.OFFLOADED,
        (
            Step(_K.RECORD_DIGESTS),
            Step(_K.BACKUP, tags=("actor",)),
            # The seed's order: gradients and optimizer state go first, the
            # params stay resident because the push still reads them.
            Step(_K.PAUSE_MEMORY, tags=("grad_buffer", "default")),
        ),
    ),
    Transition(
        Trigger.PAUSE,
        State.OFFLOADED,
        State.PAUSED,
        (
            Step(_K.RESUME_MEMORY, _E, ("weights",)),
            Step(_K.PUSH_WEIGHTS, _E),
            Step(_K.PAUSE_MEMORY, tags=("param_buffer",)),
            Step(_K.RESUME_MEMORY, _E, ("kv_cache",)),
        ),
    ),
    Transition(
        Trigger.REMATERIALIZE,
        State.PAUSED,
        State.REMATERIALIZED,
        (
            Step(_K.PAUSE_MEMORY, _E, ENGINE_TAGS),
            Step(_K.RESUME_MEMORY, tags=TRAINER_TAGS),
            Step(_K.CAST_MAIN_TO_PARAMS, only=_RM),
            Step(_K.RESTORE, tags=("actor",)),
        ),
    ),
    Transition(
        Trigger.SYNC,
        State.REMATERIALIZED,
        State.SYNCED,
        (Step(_K.PARAM_SYNC, only=_RM),),
    ),
    Transition(
        Trigger.RESUME,
        State.SYNCED,
        State.TRAINING,
        (Step(_K.VERIFY),),
    ),
)


def lifecycle_definition(transitions: tuple[Transition[State, Trigger], ...]) -> Definition[State, Trigger]:
    """A definition over the lifecycle's states and triggers, its memory steps checked too."""
    return Definition(
        states=State,
        triggers=Trigger,
        initial=State.INITIAL,
        failed=State.FAILED,
        transitions=transitions,
        checks=(_check_memory_steps,),
    )


def _check_memory_steps(d: Definition[State, Trigger]) -> list[str]:
    return [p for t in d.transitions for p in _check_memory(t)]


def _check_memory(t: Transition[State, Trigger]) -> list[str]:
    """The steps must take memory from what the source implies to what the dest implies."""
    paused = {
        Side.TRAINER: set(t.source.trainer_paused_tags),
        Side.ENGINE: set(t.source.engine_released_tags),
    }
    problems = []
    for step in t.steps:
        if step.kind not in (StepKind.PAUSE_MEMORY, StepKind.RESUME_MEMORY):
            continue
        pausing = step.kind is StepKind.PAUSE_MEMORY
        for tag in step.tags:
            if (tag in paused[step.side]) == pausing:
                problems.append(f"{t.trigger.value}: step {step} would double-{step.kind.value} {tag!r}")
            (paused[step.side].add if pausing else paused[step.side].discard)(tag)
    expected = {
        Side.TRAINER: set(t.dest.trainer_paused_tags),
        Side.ENGINE: set(t.dest.engine_released_tags),
    }
    for side in Side:
        if paused[side] != expected[side]:
            problems.append(
                f"{t.trigger.value}: leaves {side.value} tags {sorted(paused[side])} paused, "
                f"but {t.dest.value} implies {sorted(expected[side])}"
            )
    return problems


DEFINITION = lifecycle_definition(_TRANSITIONS)
"""The colocated lifecycle: ``TRAINING -> OFFLOADED -> PAUSED -> REMATERIALIZED -> SYNCED``."""

CYCLE: tuple[Trigger, ...] = DEFINITION.cycle(State.TRAINING)
"""One offload/wake cycle from TRAINING back to it, derived from the table: its order is written once."""
