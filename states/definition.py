"""The colocated lifecycle: states, triggers, steps and the transition table.

This module is pure data. ``miles_fsm.lifecycle.Lifecycle`` executes it; the
diagram in ``docs/lifecycle.md`` is generated from it; ``miles-fsm replay``
re-drives it offline. Nothing here touches a tensor or a process group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

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


@dataclass(frozen=True, slots=True)
class Transition:
    """One arrow: a trigger, its source and destination, and its steps."""

    trigger: Trigger
    source: State
    dest: State
    steps: tuple[Step, ...]

    def steps_for(self, strategy: Strategy) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.applies_to(strategy))


TRAINER_TAGS = ("param_buffer", "grad_buffer", "default")
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


@dataclass(frozen=True, slots=True)
class Definition:
    """The frozen transition table, checked when built."""

    initial: State
    failed: State
    transitions: tuple[Transition, ...]

    def __post_init__(self) -> None:
        from miles_fsm.errors import DefinitionError

        problems = list(_check(self))
        if problems:
            raise DefinitionError(problems)

    @property
    def states(self) -> tuple[State, ...]:
        return tuple(State)

    def allowed(self, state: State) -> tuple[Trigger, ...]:
        """Triggers that may fire in ``state``, in table order."""
        return tuple(t.trigger for t in self.transitions if t.source is state)

    def transition(self, state: State, trigger: Trigger) -> Transition | None:
        """The arrow for ``trigger`` out of ``state``, or None if forbidden."""
        for t in self.transitions:
            if t.source is state and t.trigger is trigger:
                return t
        return None


def _check(d: Definition) -> list[str]:
    """Definition errors, the way python-statemachine reports them."""
    problems: list[str] = []
    seen: set[tuple[State, Trigger]] = set()
    for t in d.transitions:
        key = (t.source, t.trigger)
        if key in seen:
            problems.append(f"trigger {t.trigger.value!r} leaves {t.source.value} twice")
        seen.add(key)
        if t.source is d.failed or t.dest is d.failed:
            problems.append(f"{t.trigger.value}: FAILED is entered and left only by the machine")
    for t in d.transitions:
        problems.extend(_check_memory(t))
    reachable = {d.initial}
    frontier = [d.initial]
    while frontier:
        s = frontier.pop()
        for t in d.transitions:
            if t.source is s and t.dest not in reachable:
                reachable.add(t.dest)
                frontier.append(t.dest)
    for s in State:
        if s is d.failed:
            continue
        if s not in reachable:
            problems.append(f"state {s.value} is unreachable from {d.initial.value}")
        elif not any(t.source is s for t in d.transitions):
            problems.append(f"state {s.value} is a trap: no trigger leaves it")
    return problems


def _check_memory(t: Transition) -> list[str]:
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


DEFINITION = Definition(initial=State.INITIAL, failed=State.FAILED, transitions=_TRANSITIONS)
