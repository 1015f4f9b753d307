"""Without an index, every record is checked on every event type: a changed field is never a silent ``ok``.

A crashed or live run leaves no ``rank-<r>.jsonl.index``, so the lines are
all the evidence. Each test here makes one edit a hostile or careless hand
could make to such a run (no index is written) and asserts replay never
says ``ok``: the edit is a bad line or damage under ``trace_problems``
(exit 3), or another run's record (exit 2). What the lines cannot show is
said: a run read without its index says "not provable without the index".
The random single-field edits are in ``test_replay_edit_properties.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_replay import as_json, run_cli
from trace_writer import RUN, RankWriter

from miles_fsm.replay.index import write_index

UNPROVEN = "not provable without the index"


def verified_run(root: Path, world: int = 3, cycles: int = 2) -> None:
    """A healthy run whose resumes verify 26 tensors on every rank, with a driver's own record each cycle."""
    for r in range(world):
        w = RankWriter(r, world, verified=26)
        w.cycles(1)
        for _ in range(cycles - 1):
            w.emit("demo_step", trigger=None, step=1, loss=0.5)
            w.cycles(1)
        w.write(root)


def edit(path: Path, event: str, change: Any, nth: int = 0) -> None:
    """Replace the ``nth`` record of ``event`` in ``path`` by ``change(record)`` (a dict, or the line's bytes)."""
    lines = path.read_bytes().splitlines()
    i = [i for i, ln in enumerate(lines) if orjson.loads(ln)["event"] == event][nth]
    new = change(orjson.loads(lines[i]))
    lines[i] = new if isinstance(new, bytes) else json.dumps(new, separators=(",", ":")).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")


def renumbered(path: Path, keep: Any) -> None:
    """Keep the records ``keep(record)`` accepts and renumber ``seq`` so that no record seems lost."""
    recs = [r for r in map(orjson.loads, path.read_bytes().splitlines()) if keep(r)]
    path.write_bytes(b"".join(orjson.dumps({**r, "seq": i}) + b"\n" for i, r in enumerate(recs)))


def never_ok(capsys, root: Path, *needles: str) -> dict:
    """Exit 3, not ok, the edit named under trace_problems (a bad line or damage), and the report says so too."""
    code, d = as_json(capsys, str(root))
    assert code == 3 and d["verdict"] != "ok", d["headline"]
    tp = d["trace_problems"]
    said = " | ".join([x["reason"] for x in tp["damaged"]] + [x["reason"] for x in tp["bad_lines"]])
    assert said, tp
    for needle in needles:
        assert needle in said, said
    code, out, _ = run_cli(capsys, str(root))
    assert code == 3 and not out.startswith("OK")
    return d


# ------------------------------------------------------------- the cases of issue 36


def test_a_verified_record_of_another_run_is_never_ok(tmp_path, capsys):
    """One `verified` record with another run's `run`: two runs in a file (exit 2); with --run, one record lost."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "verified", lambda r: {**r, "run": "another-run"})
    code, _, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and "rank-1.jsonl changes run midway" in err
    code, d = as_json(capsys, str(tmp_path), "--run", RUN)
    assert code == 3 and d["trace_problems"]["lost_records"] == {"1": 1}


EVENTS = ["trace_opened", "transition_started", "guard_entered", "guard_passed", "action_started",
          "action_finished", "verified", "transition_finished", "demo_step", "trace_closed"]  # fmt: skip


@pytest.mark.parametrize("event", [e for e in EVENTS if e != "transition_started"])
def test_an_epoch_not_of_its_transition_or_rank_is_damage(tmp_path, capsys, event):
    """Epoch 999 on a record of any event but transition_started: not the epoch of its transition (or, outside
    one, of the rank), so damage naming the epoch."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", event, lambda r: {**r, "epoch": 999})
    never_ok(capsys, tmp_path, "999")


def test_a_transition_started_at_an_epoch_the_rank_cannot_be_at_is_damage(tmp_path, capsys):
    """A one-rank run (no other rank to disagree with) whose transition_started jumps to epoch 999: damage."""
    verified_run(tmp_path, world=1)
    edit(tmp_path / "rank-0.jsonl", "transition_started", lambda r: {**r, "epoch": 999}, nth=3)
    never_ok(capsys, tmp_path, "epoch 999")


@pytest.mark.parametrize("event", [e for e in EVENTS if e != "demo_step"])
def test_a_record_without_its_state_is_never_ok(tmp_path, capsys, event):
    """`state` removed from a record of any schema event: the schema gives it to every one (a driver's own event
    may leave it out, as it may ``epoch`` and ``trigger``: the tracer does not stamp them)."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", event, lambda r: {k: v for k, v in r.items() if k != "state"})
    never_ok(capsys, tmp_path)


@pytest.mark.parametrize("event", ["action_started", "guard_entered", "verified", "demo_step"])
def test_a_state_other_than_the_machines_is_damage(tmp_path, capsys, event):
    """A record that names a state the re-driven machine is not in (a real state, only the wrong one)."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", event, lambda r: {**r, "state": "PAUSED"}, nth=1 if event == "action_started" else 0)
    never_ok(capsys, tmp_path, "PAUSED")


@pytest.mark.parametrize("mono", [-10**30, 10**30, 2**63, "x", None, 5])
def test_mono_ns_outside_int64_or_going_back_is_never_ok(tmp_path, capsys, mono):
    """`mono_ns` of -10^30 or 2^63 (outside int64), a string, null, or a reading before the last one."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "action_started", lambda r: {**r, "mono_ns": mono}, nth=2)
    never_ok(capsys, tmp_path)


@pytest.mark.parametrize("event", ["action_started", "action_finished"])
def test_an_action_that_is_not_a_planned_step_is_damage(tmp_path, capsys, event):
    """An action name that is not the next of the transition's planned steps."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", event, lambda r: {**r, "action": "rm -rf /"}, nth=3)
    never_ok(capsys, tmp_path, "rm -rf /")


def test_a_planned_step_removed_and_renumbered_is_damage(tmp_path, capsys):
    """A step's two records removed and the records renumbered: its transition finished before the step ran."""
    verified_run(tmp_path)
    renumbered(tmp_path / "rank-1.jsonl", lambda r: r.get("action") != "backup(actor)")
    never_ok(capsys, tmp_path, "backup(actor)")


@pytest.mark.parametrize("machine", [{"x": 1}, [], "TRAINING", {"initial": "INITIAL", "failed": "FAILED",
                                     "states": ["INITIAL", 7], "transitions": []}, None])  # fmt: skip
def test_a_machine_table_that_is_not_one_is_damage(tmp_path, capsys, machine):
    """A garbage `machine` table in trace_opened (legality would go unchecked), or none while transitions ran."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "trace_opened", lambda r: {**r, "machine": machine} if machine is not None
         else {k: v for k, v in r.items() if k != "machine"})  # fmt: skip
    never_ok(capsys, tmp_path, "machine table")


def test_a_trace_closed_state_against_the_re_driven_machine_is_damage(tmp_path, capsys):
    """Rank 0's trace_closed says PAUSED, where the machine re-driven from its records is in TRAINING."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-0.jsonl", "trace_closed", lambda r: {**r, "state": "PAUSED"})
    d = never_ok(capsys, tmp_path, "PAUSED", "the machine is in TRAINING")
    assert [x["file"].endswith("rank-0.jsonl") for x in d["trace_problems"]["damaged"]] == [True]


def test_a_rank_whose_verifications_were_removed_and_renumbered_is_damage(tmp_path, capsys):
    """Rank 1's `verified` records removed, the rest renumbered, while ranks 0 and 2 verified: damage on rank 1."""
    verified_run(tmp_path)
    renumbered(tmp_path / "rank-1.jsonl", lambda r: r["event"] != "verified")
    d = never_ok(capsys, tmp_path, "no verified record in resume")
    assert {x["rank"] for x in d["trace_problems"]["damaged"]} == {1}


def test_a_verification_of_another_tensor_count_is_damage(tmp_path, capsys):
    """Rank 1 verified 0 tensors where ranks 0 and 2 verified 26."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "verified", lambda r: {**r, "tensors": 0})
    d = never_ok(capsys, tmp_path, "verified 0 tensor(s)")
    assert {x["rank"] for x in d["trace_problems"]["damaged"]} == {1}


def test_a_blank_line_is_not_ok(tmp_path, capsys):
    """A blank line among the records: no writer writes one."""
    verified_run(tmp_path)
    lines = (tmp_path / "rank-1.jsonl").read_bytes().splitlines()
    (tmp_path / "rank-1.jsonl").write_bytes(b"\n".join([*lines[:5], b"", *lines[5:]]) + b"\n")
    never_ok(capsys, tmp_path, "blank line")


@pytest.mark.parametrize("event", ["guard_passed", "transition_finished", "demo_step", "memory_snapshot"])
def test_culprits_that_are_not_ranks_are_a_bad_line(tmp_path, capsys, event):
    """`culprits: ["x", -5, 10**40]` on a record of any event: not a list of ranks."""
    verified_run(tmp_path)
    if event == "memory_snapshot":
        edit(tmp_path / "rank-1.jsonl", "demo_step", lambda r: {**r, "event": event, "device": {}, "host": {},
                                                                  "rss": None})  # fmt: skip
    edit(tmp_path / "rank-1.jsonl", event, lambda r: {**r, "culprits": ["x", -5, 10**40]})
    never_ok(capsys, tmp_path, "culprits")


# ------------------------------------------------------------- what the lines cannot show


def test_a_run_without_its_index_says_what_is_not_provable(tmp_path, capsys):
    """A healthy run read from its lines is ok, and says an unseen edit is not provable without the index; with
    its indexes, it says nothing of the kind."""
    verified_run(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok")
    assert any(n.startswith(UNPROVEN) and "3 of 3 rank file(s)" in n for n in d["notes"]), d["notes"]
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 0 and f"note: {UNPROVEN}" in out
    for r in range(3):
        write_index(tmp_path / f"rank-{r}.jsonl", r)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok") and not any(UNPROVEN in n for n in d["notes"])


def test_a_trace_whose_trace_opened_was_renamed_is_damage(tmp_path, capsys):
    """trace_opened renamed to an event replay does not know (its seq kept, so nothing seems lost): a trace
    without the record its writer writes first, and so without a machine table, is never ok."""
    verified_run(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "trace_opened", lambda r: {**r, "event": "trace_openedx"})
    never_ok(capsys, tmp_path, "no trace_opened")


def test_a_steps_guard_passed_without_being_entered_is_damage(tmp_path, capsys):
    """The guard of a step outside any transition (the train step's) renamed away: its guard_passed follows
    no guard_entered."""
    for r in range(2):
        w = RankWriter(r, 2, verified=26)
        w.cycles(1)
        w.train_guard()
        w.write(tmp_path)
    edit(tmp_path / "rank-1.jsonl", "guard_entered", lambda r: {**r, "event": "guard_enteredx"}, nth=1)
    never_ok(capsys, tmp_path, "out of its guard's order")


def test_a_trace_of_an_earlier_v2_writer_without_scheme_or_waited_s_reads_ok(tmp_path, capsys):
    """Schema v2 gained `scheme` and `waited_s` on verification records (2026-12-04) without a version bump: a
    trace written before has neither, on every rank, and is healthy (ok, with the unproven note), not damage.
    Where one is present it is still checked."""
    verified_run(tmp_path)
    for r in range(3):
        path = tmp_path / f"rank-{r}.jsonl"
        recs = [orjson.loads(ln) for ln in path.read_bytes().splitlines()]
        old = [{k: v for k, v in rec.items() if k not in ("scheme", "waited_s")} for rec in recs]
        path.write_bytes(b"".join(orjson.dumps(rec) + b"\n" for rec in old))
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok"), d["trace_problems"]
    assert any(UNPROVEN in n for n in d["notes"]), d["notes"]
    edit(tmp_path / "rank-1.jsonl", "verified", lambda r: {**r, "scheme": 7})
    never_ok(capsys, tmp_path, "scheme holds")
