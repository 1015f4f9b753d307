"""The guard's store publisher: it stops when the lifecycle closes, and its store errors surface."""

from __future__ import annotations

import pytest

import ranks_guard
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow


def test_closing_the_lifecycle_stops_and_joins_the_guards_publisher_thread(assert_no_leftovers):
    out = run_ranks(ranks_guard.publisher_stops_at_close, 2, timeout_s=30)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.result for o in out] == [{"before": 1, "after": 0, "after_twice": 0}] * 2


def test_a_store_that_refuses_writes_is_reported_and_never_fails_a_guard_that_agreed(assert_no_leftovers):
    """Rank 1's publisher cannot write its arrival: each guard still passes on both ranks, and rank 1 warns
    with a GuardStoreWarning naming its key and the store's error. At the guard rank 0 never comes to,
    rank 1 still names rank 0 missing (the store's error does not replace it) and says, in a note, that
    the store refused its records."""
    out = run_ranks(ranks_guard.store_set_fails, 2, timeout_s=30, linger_s=5)
    assert all(o.ok for o in out), [o.error for o in out]
    healthy, failing = out[0].result, out[1].result
    assert healthy == {"warnings": [], "passed": 2}
    assert failing["passed"] == 2
    assert len(failing["warnings"]) == 2  # one per guard it waited at: each arrival was tried once
    for rank, key, cause in failing["warnings"]:
        assert rank == 1 and key.endswith("last/1") and cause.startswith("injected store failure")
    assert failing["error"] == "GuardTimeoutError" and failing["missing"] == [0]
    assert any("could not write its guard record" in n and "injected store failure" in n for n in failing["notes"])
