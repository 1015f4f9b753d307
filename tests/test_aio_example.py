"""examples/async_rollout_loop.py runs end to end, as CI and users run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "async_rollout_loop.py"
CYCLE = [
    "TRAINING->OFFLOADED",
    "OFFLOADED->PAUSED",
    "PAUSED->REMATERIALIZED",
    "REMATERIALIZED->SYNCED",
    "SYNCED->TRAINING",
]


def _run(*args: str, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--json", *args],
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_example_runs_verified_rl_steps_with_concurrent_generation(backend):
    """One rank, 3 RL steps: each step's 16 concurrent requests are served in batches of 8 inside the
    rollout window, every cycle passes verification and ends in TRAINING, every change reaches the
    monitor task, and the event loop never stalls for a transition's length (250 ms: the margin is for a
    2-core machine under load; a loop blocked by a transition stalls for all of it)."""
    out = _run("--backend", backend, "--steps", "3", timeout=60)
    assert out["ok"] is True
    (rank,) = out["ranks"]
    assert rank["backend"] == backend
    assert rank["state"] == "TRAINING" and rank["epoch"] == 3
    assert [s["epoch"] for s in rank["steps"]] == [1, 2, 3]
    assert rank["batches"] == 6
    assert rank["changes"] == ["INITIAL->TRAINING", *CYCLE * 3]
    assert rank["ticks"] > 0 and rank["worst_stall_s"] < 0.250


@pytest.mark.slow
def test_the_example_runs_on_two_ranks(tmp_path):
    """Two gloo ranks (one process each) run the same loop in lockstep: both finish every step,
    and their traces show the guarded param sync of every cycle."""
    out = _run("--ranks", "2", "--steps", "2", "--trace-dir", str(tmp_path), timeout=120)
    assert out["ok"] is True
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["state"] == "TRAINING" and r["epoch"] == 2
        assert r["changes"] == ["INITIAL->TRAINING", *CYCLE * 2]
    for rank in (0, 1):
        records = [orjson.loads(line) for line in (tmp_path / f"rank-{rank}.jsonl").read_bytes().splitlines()]
        passed = [x["epoch"] for x in records if x["event"] == "guard_passed" and x["trigger"] == "sync"]
        assert passed == [1, 2]
