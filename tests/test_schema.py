"""The trace schema: one table of events, the doc that shows it, and the records writers really write."""

from __future__ import annotations

import re
from pathlib import Path

import orjson

from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm.trace.schema import COMMON_FIELDS, EVENTS, SCHEMA_VERSION, TRACE_OPENED
from miles_fsm.states import DEFINITION
from miles_fsm.testing import run_cycles
from toy import ToyEngine, ToyTrainer

DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-schema.md"


def test_the_doc_lists_exactly_the_schema_events():
    """docs/trace-schema.md's event table names every event of miles_fsm.trace.schema.EVENTS, and no other."""
    text = DOC.read_text()
    common, events = text.split("## Events", 1)
    assert set(re.findall(r"^\| `([a-z_]+)` \|", common, re.M)) == set(COMMON_FIELDS)
    assert set(re.findall(r"^\| `([a-z_]+)` \|", events, re.M)) == set(EVENTS)
    assert f"version {SCHEMA_VERSION}" in DOC.read_text()


def test_written_records_use_schema_events_with_their_fields(tmp_path):
    """A traced cycle writes only schema events, each with the common fields and the event's own."""
    with Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(), config=LifecycleConfig(trace_dir=tmp_path)) as lc:
        lc.start()
        run_cycles(lc, 2)
    records = [orjson.loads(line) for line in (tmp_path / "rank-0.jsonl").read_bytes().splitlines()]
    assert {r["event"] for r in records} >= {"trace_opened", "transition_started", "action_finished", "verified"}
    for r in records:
        assert r["event"] in EVENTS, r
        missing = (set(COMMON_FIELDS) | set(EVENTS[r["event"]])) - set(r)
        assert not missing, (r["event"], missing)
        assert r["v"] == SCHEMA_VERSION


def test_the_trace_names_its_machine(tmp_path):
    """trace_opened carries the writer's transition table, with this rank's steps, for replay to re-drive."""
    with Lifecycle(trainer=ToyTrainer(), config=LifecycleConfig(trace_dir=tmp_path)):
        pass
    opened = orjson.loads((tmp_path / "rank-0.jsonl").read_bytes().splitlines()[0])
    assert opened["event"] == TRACE_OPENED
    machine = opened["machine"]
    assert machine["initial"] == DEFINITION.initial.value and machine["failed"] == "FAILED"
    arrows = {(src, trig): (dest, steps) for src, trig, dest, steps in machine["transitions"]}
    assert arrows[("SYNCED", "resume")] == ("TRAINING", ["verify"])
    # Without an engine, engine steps are not this rank's plan.
    assert arrows[("OFFLOADED", "pause")] == ("PAUSED", ["pause_memory(param_buffer)"])
