"""Replay names what the evidence shows and nothing more: a cancel is no divergence, a rank that closed its
trace did not crash, a survivor's error never makes it the culprit, and a live run's silence is not a hang.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from miles_fsm.apps.cli import main
from trace_writer import RankWriter

from miles_fsm.launch.local import run_ranks


def as_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", *argv, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_a_cancel_before_the_guard_is_no_divergence_and_names_the_cancelling_rank(tmp_path, capsys,
                                                                                 assert_no_leftovers):
    """A real 2-rank anyio run: rank 1's sync is cancelled before its guard, rank 0 times out at the guard.
    Replay says rank 1 cancelled (verdict stuck, how cancelled, culprit rank 1), not that the ranks disagree on
    guarded."""
    from test_aio_ranks import abandon_before_guard

    out = run_ranks(abandon_before_guard, 2, timeout_s=30,
                    kwargs={"mode": "cancel", "backends": ("asyncio", "trio"), "trace_dir": str(tmp_path)})
    assert all(o.ok for o in out), [o.error for o in out]
    code, d = as_json(capsys, str(tmp_path))
    assert d["first_divergence"] is None, d["first_divergence"]
    assert (code, d["verdict"], d["culprit"]["ranks"], d["culprit"]["transition"]) == (3, "stuck", [1], "sync")
    [s] = d["stuck"]
    assert (s["rank"], s["how"], s["accused_by"]) == (1, "cancelled", [0])
    assert "before its guard" in d["headline"] and "disagree" not in d["headline"]


LOST = {"error": "PeerLostError", "message": "the guard of sync lost its connection to rank(s) 1",
        "fields": {"missing": [1]}}


def test_a_rank_that_closed_its_trace_is_not_said_to_have_crashed_and_its_own_error_leads(tmp_path, capsys):
    """Rank 1 left on its own error (closed unclean, outside any transition); the others then lost it at the
    guard. Replay leads with rank 1's own error, and never says its process was gone."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        if r == 1:
            w.emit("demo_failed", where="train", error="ValueError", message="bad batch")
            w.close(error="ValueError", message="bad batch")
        else:
            w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
            w.transition("sync", guard_error=LOST)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (d["verdict"], d["culprit"]["ranks"]) == ("crashed", [1])
    assert "ValueError" in d["headline"] and "bad batch" in d["headline"]
    text = orjson.dumps(d).decode()
    assert "process was gone" not in text and "rank 1 crashed" not in text


def test_a_rank_that_finished_cleanly_while_others_needed_it_left_and_did_not_crash(tmp_path, capsys):
    """Rank 1 closed its trace cleanly one cycle early; the others lost it at the next guard: it left."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        if r != 1:
            w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
            w.transition("sync", guard_error=LOST)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    [s] = d["stuck"]
    assert (s["rank"], s["how"], d["culprit"]["ranks"]) == (1, "left", [1])
    assert "closed its trace cleanly" in s["evidence"] and "process was gone" not in s["evidence"]


def test_mutual_accusations_after_a_hang_name_the_rank_the_first_timeout_named(tmp_path, capsys):
    """Like --inject undeclared --no-audit: rank 0 times out naming rank 1 and leaves; rank 1 then loses
    rank 0 and names it. Both closed their traces: rank 0 left because of rank 1, so rank 1 is the culprit."""
    timeout = {"error": "RuntimeError", "message": "Timed out waiting 5000ms for recv", "transport": "timeout"}
    reset = {"error": "RuntimeError", "message": "Connection closed by peer", "transport": "peer_lost"}
    located = {"error": "FaultLocatedError", "message": "culprit rank(s) {}", "transport": None}
    for r in range(2):
        w = RankWriter(r, 2)
        w.cycles(1)
        other = 1 - r
        w.emit("demo_failed", where="train", culprits=[other], dt=5.0 if r == 0 else 5.2, **(timeout if r == 0 else reset))
        w.close(**{**located, "message": located["message"].format(other), "fields": {"culprits": [other]}})
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert d["culprit"]["ranks"] == [1], d["headline"]
    assert all(s["rank"] != 0 or s["how"] != "crashed" for s in d["stuck"])


def test_survivors_errors_naming_a_killed_rank_never_make_them_the_culprits(tmp_path, capsys):
    """Rank 1 is killed right after resume; the others fail the train step's guard (outside any transition)
    with PeerLostError naming it. The culprit is rank 1, never the survivors (a SIGKILL race seen in the demo)."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        if r != 1:
            w.emit("guard_entered", trigger="train", key=7, collectives=["all_reduce@dp[1:float32]"], tensors=None)
            w.emit("guard_failed", trigger="train", dt=0.5, **LOST)
            w.emit("demo_failed", trigger=None, where="train", **LOST)
            w.close(**LOST)
        else:
            w.cut = True
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (d["verdict"], d["culprit"]["ranks"]) == ("crashed", [1]), d["headline"]


def test_a_live_run_replayed_mid_flight_is_incomplete_not_stuck(tmp_path, capsys):
    """Rank 0 is inside an action and ranks 1-2 entered sync's guard milliseconds ago: nothing is stuck yet
    (the guard waits 5 s). Incomplete, and no rank is the culprit."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause")
        if r == 0:
            w.transition("rematerialize", stop="restore(actor)")
        else:
            w.transition("rematerialize")
            w.transition("sync", stop="guard")
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "incomplete"), d["headline"]
    assert d["culprit"] is None or d["culprit"]["ranks"] == []
    assert all(s["how"] == "silent" for s in d["stuck"])
