"""The transition table: checked when built, and the docs generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_fsm import State, Trigger
from miles_fsm.errors import DefinitionError
from miles_fsm.states.diagram import lifecycle_markdown
from miles_fsm.states import DEFINITION, Side, Step, StepKind, Transition, lifecycle_definition

CYCLE = [State.TRAINING, State.OFFLOADED, State.PAUSED, State.REMATERIALIZED, State.SYNCED]


def test_the_cycle_is_the_brief_cycle():
    """Following the one allowed trigger from TRAINING visits the five states in the brief's order."""
    state, seen = State.TRAINING, []
    for _ in range(5):
        seen.append(state)
        (trigger,) = DEFINITION.allowed(state)
        state = DEFINITION.transition(state, trigger).dest
    assert seen == CYCLE and state is State.TRAINING
    assert DEFINITION.allowed(State.INITIAL) == (Trigger.START,)
    assert DEFINITION.allowed(State.FAILED) == ()


def test_memory_facts_are_properties_of_the_state():
    """Residency follows from the state: trainer memory is resident only outside OFFLOADED/PAUSED."""
    assert [s.trainer_resident for s in CYCLE] == [True, False, False, True, True]
    assert State.PAUSED.engine_can_generate and not State.TRAINING.engine_can_generate
    assert not State.FAILED.trainer_resident


def test_unreachable_and_trap_states_are_rejected():
    """A table that strands a state, or never leaves one, fails when it is built."""
    only_start = tuple(t for t in DEFINITION.transitions if t.trigger is Trigger.START)
    with pytest.raises(DefinitionError) as info:
        lifecycle_definition(only_start)
    text = str(info.value)
    assert "state OFFLOADED is unreachable" in text
    assert "state TRAINING is a trap" in text


def test_a_double_pause_in_the_table_is_rejected():
    """A transition whose steps pause a tag its source already paused fails at build time."""
    bad = tuple(
        Transition(t.trigger, t.source, t.dest, t.steps + (Step(StepKind.PAUSE_MEMORY, tags=("default",)),))
        if t.trigger is Trigger.PAUSE
        else t
        for t in DEFINITION.transitions
    )
    with pytest.raises(DefinitionError, match="double-pause_memory 'default'"):
        lifecycle_definition(bad)


def test_steps_leave_memory_where_the_destination_says():
    """The shipped table's memory steps match every destination's implied paused tags."""
    for t in DEFINITION.transitions:
        paused = {Side.TRAINER: set(t.source.trainer_paused_tags), Side.ENGINE: set(t.source.engine_released_tags)}
        for s in t.steps:
            if s.kind is StepKind.PAUSE_MEMORY:
                paused[s.side] |= set(s.tags)
            elif s.kind is StepKind.RESUME_MEMORY:
                paused[s.side] -= set(s.tags)
        assert paused[Side.TRAINER] == t.dest.trainer_paused_tags, t.trigger
        assert paused[Side.ENGINE] == t.dest.engine_released_tags, t.trigger


def test_lifecycle_doc_is_generated_from_the_definition():
    """docs/lifecycle.md is exactly what `miles-fsm diagram` prints; regenerate it when the table changes."""
    doc = Path(__file__).parents[1] / "docs" / "lifecycle.md"
    assert doc.read_text() == lifecycle_markdown(), "run: miles-fsm diagram > docs/lifecycle.md"
