"""A rank that raised inside a transition is named by every survivor: the rank, the step and the exception type.

Real ranks over gloo: rank 1's rematerialize cast raises; ranks 0 and 2 go on
to the guard of sync, where rank 1 never comes. Before, they raised
``GuardTimeoutError`` / ``PeerLostError`` with ``missing=()`` and a message
that named nobody.
"""

from __future__ import annotations

import pytest

import ranks_live
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0


def _check_names_the_failed_rank(o, *, error: str = "PeerFailedError") -> None:
    assert o.error is not None and o.error.type == error, o
    failed = o.error.attrs["failed"]
    assert list(failed) == [1], failed
    seen = failed[1]
    assert (seen.rank, seen.trigger, seen.step, seen.error) == (1, "rematerialize", "cast_main_to_params", "RuntimeError")
    first = o.error.message.splitlines()[0]
    assert "rank(s) 1 failed" in first and "cast_main_to_params" in first and "RuntimeError" in first, first
    assert "miles-fsm replay" in o.error.message


@pytest.mark.parametrize("stay_s", [0.0, 2 * TIMEOUT_S], ids=["exits", "stays"])
def test_every_survivor_names_the_rank_whose_step_raised(stay_s, assert_no_leftovers):
    """Whether the failed rank exits at once (its peers lose it) or stays alive (they time out), ranks 0 and 2
    raise PeerFailedError naming rank 1, its step and its exception type, within the guard timeout."""
    out = run_ranks(ranks_live.one_step_raises, 3, timeout_s=60, linger_s=3 * TIMEOUT_S,
                    kwargs={"bad": 1, "stay_s": stay_s, "timeout_s": TIMEOUT_S})  # fmt: skip
    assert out[1].error is not None and out[1].error.type == "RuntimeError", out[1]
    for o in (out[0], out[2]):
        _check_names_the_failed_rank(o)
        assert o.error.attrs["culprits"] == (1,)
        assert o.elapsed_s is not None and o.elapsed_s < TIMEOUT_S + 5.0


def test_a_failed_rank_and_a_missing_one_are_both_named(assert_no_leftovers):
    """Rank 1's step raised and rank 2 hangs before the guard: rank 0's GuardTimeoutError names rank 2 as
    missing and rank 1 as failed, with its step and exception type."""
    out = run_ranks(ranks_live.one_step_raises, 3, timeout_s=60, linger_s=TIMEOUT_S + 3,
                    kwargs={"bad": 1, "stay_s": 2 * TIMEOUT_S, "hang": 2, "timeout_s": TIMEOUT_S})  # fmt: skip
    o = out[0]
    assert o.error is not None and o.error.type == "GuardTimeoutError", o
    assert o.error.attrs["missing"] == (2,)
    assert list(o.error.attrs["failed"]) == [1]
    seen = o.error.attrs["failed"][1]
    assert (seen.step, seen.error) == ("cast_main_to_params", "RuntimeError")
    assert "rank(s) 2 did not reach the guard" in o.error.message and "rank(s) 1 failed" in o.error.message
