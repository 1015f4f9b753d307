"""The guard's failure path stays O(1) store reads per survivor but one, and every survivor names the same ranks."""

from __future__ import annotations

import pytest

import ranks_guard_scale
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow

WORLD = 4
HUNG = 3


def _survivors(out):
    survivors = [o for o in out if o.rank != HUNG]
    for o in survivors:
        assert o.ok, o.error
        assert o.result["error"] == "GuardTimeoutError", o.result
    return [o.result for o in survivors]


def test_one_reporter_reads_the_store_and_the_others_wait_for_its_report(assert_no_leftovers):
    """A rank never arrives: every survivor raises GuardTimeoutError with the same missing ranks and
    last sighting, but only one of them reads the ranks' keys (check + multi_get); each other one
    spends a constant number of store reads (claim, wait, get), whatever the world size."""
    out = run_ranks(ranks_guard_scale.one_rank_hangs, WORLD, timeout_s=60, linger_s=8,
                    kwargs={"hang_rank": HUNG, "timeout_s": 1.0})
    results = _survivors(out)
    assert all(r["missing"] == [HUNG] for r in results)
    assert len({str(r["last_seen"]) for r in results}) == 1
    assert results[0]["last_seen"] == {HUNG: (0, "sync", "passed guard of")}
    readers = [r for r in results if r["reads"]["multi_get"] > 0]
    assert len(readers) == 1, [r["reads"] for r in results]
    for r in results:
        if r is not readers[0]:
            assert r["reads"] == {"get": 1, "multi_get": 0, "check": 0, "wait": 1, "add": 1}, r["reads"]


def test_without_a_report_every_survivor_reads_the_store_itself(assert_no_leftovers):
    """The reporter died before publishing (here: every rank believes another claimed the failure):
    the survivors stop waiting after the report wait and name the missing rank all the same."""
    out = run_ranks(ranks_guard_scale.one_rank_hangs, WORLD, timeout_s=60, linger_s=8,
                    kwargs={"hang_rank": HUNG, "timeout_s": 1.0, "claimed": True, "report_wait_s": 0.5})
    results = _survivors(out)
    assert all(r["missing"] == [HUNG] for r in results)
    assert all(r["reads"]["multi_get"] == 1 and r["reads"]["wait"] == 1 for r in results)
