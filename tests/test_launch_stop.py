"""The local launcher tells every rank it stops why, so each can say so in its trace before it exits."""

from __future__ import annotations

import time

import orjson
import pytest

import ranks_stop
from miles_fsm.launch.local import EXIT_STOPPED, run_ranks

pytestmark = pytest.mark.slow


def _stops(out) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): orjson.loads(p.read_bytes()) for p in out.glob("stopped-*.json")}


def test_a_rank_stopped_after_a_peer_failed_is_told_who_failed_even_inside_a_collective(tmp_path, assert_no_leftovers):
    """Rank 0 fails; ranks 1 and 2, blocked in an all-reduce it never joins, are stopped after the linger.
    Their callbacks run (from the watchdog thread, the main thread still in the collective) with
    RankStoppedError(reason=peer_failed, failed=[0]), and they exit on their own, not by SIGKILL."""
    started = time.monotonic()
    out = run_ranks(ranks_stop.zero_fails_one_waits_in_a_collective, 3, timeout_s=120, pg_timeout_s=120,
                    linger_s=1.0, kwargs={"out": str(tmp_path)})
    took = time.monotonic() - started
    assert out[0].error is not None and out[0].error.type == "ValueError"
    assert [(o.killed, o.exitcode) for o in out[1:]] == [(True, EXIT_STOPPED)] * 2
    stops = _stops(tmp_path)
    assert sorted(stops) == [1, 2]
    for rank, s in stops.items():
        assert (s["type"], s["rank"], s["reason"], s["failed"]) == ("RankStoppedError", rank, "peer_failed", [0])
        assert "rank(s) 0 failed" in s["message"]
    assert took < 60, f"the stop took {took:.1f} s: the ranks waited for their collective's timeout"


def test_a_rank_stopped_at_the_runs_time_limit_is_told_so(tmp_path, assert_no_leftovers):
    out = run_ranks(ranks_stop.every_rank_sleeps, 2, timeout_s=3, kwargs={"out": str(tmp_path)})
    assert [(o.killed, o.exitcode) for o in out] == [(True, EXIT_STOPPED)] * 2
    stops = _stops(tmp_path)
    assert {r: (s["type"], s["reason"], s["signal"]) for r, s in stops.items()} == {
        0: ("RankStoppedError", "timeout", None), 1: ("RankStoppedError", "timeout", None)}
