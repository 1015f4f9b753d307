"""What the demo says agrees with what happened: the culprit replay names, and faults that went unnoticed.

Each case runs ``miles-fsm demo`` in-process on 2 ranks, as a user would,
and reads its printed summary and exit code.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from miles_fsm.apps.cli import main

pytestmark = pytest.mark.slow


def _demo(trace_dir: Path, capfd, *argv: str) -> tuple[int, str]:
    rc = main(["demo", "--ranks", "2", "--steps", "2", "--guard-timeout", "3", "--trace-dir", str(trace_dir), *argv])
    out, _ = capfd.readouterr()
    return rc, out


def _replay_json(trace_dir: Path, capfd) -> dict:
    main(["replay", str(trace_dir), "--json"])
    out, _ = capfd.readouterr()
    return orjson.loads(out)


def test_an_unaudited_undeclared_collective_names_the_rank_replay_names(tmp_path, capfd, assert_no_leftovers):
    """``--inject undeclared:0:1 --no-audit`` on 2 ranks: rank 1 times out and names rank 0, which then loses
    rank 1 and names it back. The demo named both (``culprit: rank 0, 1``) while replay named rank 0; the
    errors that name each other decide nothing, so the demo names replay's culprit: rank 0."""
    rc, out = _demo(tmp_path, capfd, "--inject", "undeclared:0:1", "--no-audit")
    assert rc == 1, out
    named = re.search(r"^FAILED.*?culprit: (.*)$", out, re.M)
    assert named is not None and named.group(1) == "rank 0", out
    replay = _replay_json(tmp_path, capfd)
    assert replay["culprit"]["ranks"] == [0], replay["culprit"]


@pytest.mark.parametrize("fault", [["diverge"], ["undeclared", "--no-audit"]], ids=["diverge", "undeclared"])
def test_a_fault_on_every_rank_fails_the_run_and_says_why(fault, tmp_path, capfd, assert_no_leftovers):
    """The same fault injected on every rank at one step leaves the ranks agreeing with each other, so no
    guard sees it: the run finished and exited 0 without a word. It must exit 1 and say that the injected
    faults went unnoticed, and why (every rank was wrong alike)."""
    kind, *extra = fault
    rc, out = _demo(tmp_path, capfd, "--inject", f"{kind}:0:2", "--inject", f"{kind}:1:2", *extra)
    assert rc == 1, out
    assert f"the injected fault(s) {kind}:0:2, {kind}:1:2 went unnoticed" in out, out
    assert f"{kind} on every rank at step 2" in out and "wrong alike" in out, out
    assert "OK:" not in out, out
