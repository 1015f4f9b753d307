"""The demo's fault matrix: every injection kind, mode, rank and step it samples, end to end on 3 ranks.

Each case runs ``miles-fsm demo`` in-process (the forkserver is shared, so a
case costs its guard timeout, not a torch import), once per session through
the ``demo_runs`` fixture (test_replay_demo and test_flight_recorder check the
same runs), and checks the contract:
the exit code, the culprit named, no traceback on stderr (the ranks write
to the same file descriptor), no process left, every rank out within the
guard timeout plus 10 s *of the fault* (its timestamp in the traces, not
interpreter start), and replay not calling an injected run healthy.
"""

from __future__ import annotations

import itertools
import random
import re
import time
from pathlib import Path

import orjson
import pytest
from demo_runs import DemoRun

from miles_fsm.apps.cli import main
from miles_fsm.apps.demo import INJECTION_KINDS

RANKS, STEPS, GUARD_S = 3, 2, 2.0
#: The contract: every rank out within the guard timeout plus this, from the fault.
MARGIN_S = 10.0
MODES = ("rematerialize", "backup")
_FAILURES = ("guard_failed", "transition_failed", "verify_failed", "demo_failed")

#: Every kind in both modes at one rank and step.
#: The faults that fail the run; a ``leak`` does not (the run goes on, warned): tests/test_drift.py checks it.
FAILING = tuple(k for k in INJECTION_KINDS if k != "leak")
BASE = [(kind, mode, 1, 2) for kind in FAILING for mode in MODES]
#: A fixed sample of the rest of kind x mode x rank x step.
SAMPLED = random.Random(14).sample(
    sorted(set(itertools.product(FAILING, MODES, range(RANKS), range(1, STEPS + 1))) - set(BASE)), 6
)


def _records(trace_dir: Path, rank: int) -> list[dict]:
    path = trace_dir / f"rank-{rank}.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line] if path.exists() else []


def fault_wall(trace_dir: Path, culprit: int, ranks: int = RANKS) -> float:
    """When the fault happened, from the traces: the culprit's last record before it stopped
    (a hang or crash ends its trace there), or the first failure any rank recorded."""
    own = [r for r in _records(trace_dir, culprit) if r["event"] != "trace_closed"]
    times = [own[-1]["wall"]] if own else []
    for rank in range(ranks):
        times += [r["wall"] for r in _records(trace_dir, rank) if r["event"] in _FAILURES][:1]
    return min(times)


def shared_run(demo_runs, mode: str, *inject: str) -> DemoRun:
    """This module's sizes of run, shared with every test of the session that asks for the same one."""
    return demo_runs.get(ranks=RANKS, steps=STEPS, guard_s=GUARD_S, mode=mode, inject=inject)


def run_case(argv: list[str], trace_dir: Path, capfd) -> tuple[int, str, str, float]:
    rc = main(["demo", "--ranks", str(RANKS), "--steps", str(STEPS), "--guard-timeout", str(GUARD_S),
               "--trace-dir", str(trace_dir), *argv])
    out_at = time.time()  # run_demo returns once every rank is joined or killed
    out, err = capfd.readouterr()
    return rc, out, err, out_at


def replay_code(trace_dir: Path, capfd) -> int:
    code = main(["replay", str(trace_dir)])
    capfd.readouterr()
    return code


def _case(kind: str, mode: str, rank: int, step: int):
    return pytest.param(kind, mode, rank, step, id=f"{kind}:{rank}:{step}-{mode}")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "mode", "rank", "step"), [_case(*c) for c in BASE + SAMPLED])
def test_injected_fault_meets_the_contract(kind, mode, rank, step, demo_runs, capfd):
    """An injection ends the run with exit 1, names the injected rank as the culprit, prints no
    traceback, leaves no process, has every rank out within guard + 10 s of the fault, and replay
    diagnoses a problem (exit 3)."""
    run = shared_run(demo_runs, mode, f"{kind}:{rank}:{step}")
    rc, out, err, out_at, tmp_path = run.rc, run.out, run.err, run.out_at, run.trace_dir
    assert not run.left, f"processes left behind: {sorted(run.left)}"
    assert rc == 1, out + err
    assert f"culprit: rank {rank}\n" in out, out
    assert "Traceback" not in err, err
    took = out_at - fault_wall(tmp_path, rank)
    assert took < GUARD_S + MARGIN_S, f"{took:.1f} s from the fault to the last rank out"
    code = replay_code(tmp_path, capfd)
    print(f"FAULT-MATRIX {kind}:{rank}:{step} {mode}: {took:.2f} s from fault to last rank out")
    assert code == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_uninjected_run_exits_0_and_replays_ok(mode, demo_runs, capfd):
    """Without an injection the same 3-rank run exits 0 with every step verified, and replays as ok."""
    run = shared_run(demo_runs, mode)
    rc, out, err, tmp_path = run.rc, run.out, run.err, run.trace_dir
    assert not run.left, f"processes left behind: {sorted(run.left)}"
    assert rc == 0, out + err
    assert f"OK: {RANKS * STEPS} cycles verified bit-exact" in out
    assert "Traceback" not in err, err
    assert replay_code(tmp_path, capfd) == 0


@pytest.mark.slow
def test_the_same_crash_names_the_same_culprit_every_time(tmp_path, capfd, assert_no_leftovers):
    """crash:0:2 at 3 ranks, five times: the vote names rank 0 alone every time (it once named 0, 1, 2:
    the survivors' views of who failed first race, a dead process does not)."""
    named = []
    for i in range(5):
        rc, out, err, _ = run_case(["--inject", "crash:0:2"], tmp_path / str(i), capfd)
        named.append(re.search(r"^FAILED.*?culprit: (.*)$", out, re.M).group(1))
    assert named == ["rank 0"] * 5
