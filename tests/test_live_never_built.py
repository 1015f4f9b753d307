"""A rank that never builds its Lifecycle is named by the others, within the guard timeout, in their traces too.

Building a Lifecycle is collective (its guard's gloo group). Before, a rank
whose driver raised at init left the others in torch's store until the
process group's timeout, with ``DistStoreError: wait timeout ... keys:
/0//1//cpu//0/1``: no rank named, no trace written.
"""

from __future__ import annotations

import orjson
import pytest

import ranks_live
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0


def test_the_others_name_the_rank_that_never_built_its_lifecycle(tmp_path, assert_no_leftovers):
    """Rank 1 raises before building its Lifecycle: ranks 0 and 2 raise PeerNeverJoinedError naming rank 1
    within the guard timeout (not the process group's 20 s), and their traces record the wait and who never came."""
    out = run_ranks(ranks_live.one_never_builds, 3, timeout_s=60, pg_timeout_s=20,
                    kwargs={"bad": 1, "timeout_s": TIMEOUT_S, "trace_dir": str(tmp_path)})  # fmt: skip
    assert out[1].error is not None and out[1].error.type == "ValueError"
    for o in (out[0], out[2]):
        assert o.error is not None and o.error.type == "PeerNeverJoinedError", o
        assert o.error.attrs["missing"] == (1,) and o.error.attrs["timeout_s"] == TIMEOUT_S
        assert "rank(s) 1 never built" in o.error.message
        assert o.elapsed_s is not None and o.elapsed_s < TIMEOUT_S + 4.0
        records = [orjson.loads(line) for line in (tmp_path / f"rank-{o.rank}.jsonl").read_bytes().splitlines()]
        assert records[0]["event"] == "trace_opened" and records[0]["rank"] == o.rank
        failed = [r for r in records if r["event"] == "guard_failed"]
        assert len(failed) == 1 and failed[0]["error"] == "PeerNeverJoinedError"
        assert failed[0]["fields"]["missing"] == [1]
        assert records[-1]["event"] == "trace_closed"
