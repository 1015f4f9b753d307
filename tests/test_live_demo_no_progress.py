"""An injection that leaves no rank able to make progress is refused up front, not run to the run timeout.

``--inject hang:0:1 --inject hang:1:1`` (or ``stall`` on every rank) left no
rank waiting on a timer: nobody reached a guard or a collective, so the run
ended only at its run timeout (127 s at 3 steps, about 2 000 000 s at
``--steps 100000``) with ``culprit: unknown``. The refusal is exact: a mix in
which some rank still reaches a guard or a collective is run, and ends there.
"""

from __future__ import annotations

import time

import pytest

from miles_fsm.apps.cli import main
from miles_fsm.apps.demo.config import DemoConfig, Injection


def _config(ranks: int, steps: int, *specs: str) -> DemoConfig:
    return DemoConfig(ranks=ranks, steps=steps, injections=tuple(Injection.parse(s) for s in specs))


NO_PROGRESS = [
    (2, 3, ("hang:0:1", "hang:1:1")),
    (2, 100_000, ("hang:0:100000", "hang:1:100000")),
    (3, 4, ("stall:0:2", "stall:1:2", "stall:2:2")),
    (3, 4, ("hang:0:3", "hang:1:3", "hang:2:3", "stall:0:4")),  # the later stall never comes
    (2, 4, ("stall:0:1", "stall:1:1", "crash:0:2")),  # the crash comes after everyone stalled
    (2, 4, ("crash:0:1", "hang:0:1", "hang:1:1")),  # one fault per rank and step: the later one is armed
]

RUNS = [
    (2, 4, ("hang:0:1", "stall:1:1")),  # rank 1 reaches the offload guard: it times out and names rank 0
    (2, 4, ("hang:0:1", "hang:1:2")),  # rank 1 waits at step 1's guard
    (2, 4, ("stall:0:1", "stall:1:2")),  # rank 1 waits in the train collective of step 1
    (3, 4, ("hang:0:1", "hang:1:1")),  # rank 2 is left to time out
    (2, 4, ("diverge:0:1", "hang:0:2", "hang:1:2")),  # the divergence ends the run first
    (2, 4, ("corrupt:1:2", "stall:0:2", "stall:1:3")),  # rank 1's verification fails before rank 0 stalls
]


@pytest.mark.parametrize(("ranks", "steps", "specs"), NO_PROGRESS, ids=lambda v: str(v))
def test_injections_that_leave_no_rank_to_notice_are_refused(ranks, steps, specs):
    """Every rank stopped at the same point, with no fault of another kind ending the run before it: one problem
    naming the flags and why."""
    problems = _config(ranks, steps, *specs).problems()
    assert len(problems) == 1 and "no rank is left" in problems[0], problems


@pytest.mark.parametrize(("ranks", "steps", "specs"), RUNS, ids=lambda v: str(v))
def test_injections_that_leave_a_rank_to_notice_run(ranks, steps, specs):
    """Some rank still reaches a guard or a collective, so its timeout ends the run and names the culprit."""
    assert _config(ranks, steps, *specs).problems() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--inject", "hang:0:1", "--inject", "hang:1:1"],
                                  ["--steps", "100000", "--inject", "stall:0:100000", "--inject", "stall:1:100000"]])
def test_the_demo_refuses_them_at_once_with_one_line(argv, capsys, assert_no_leftovers):
    """``miles-fsm demo`` exits 2 at once, with one line on stderr and no process started."""
    from conftest import child_pids

    before = child_pids()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--ranks", "2", "--steps", "3", *argv])
    assert exc.value.code == 2 and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no rank is left" in err and "Traceback" not in err, err
    assert child_pids() == before
