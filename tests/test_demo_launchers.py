"""``miles-fsm demo`` beyond the local launcher: torchrun workers, Ray actors, real megatron-core on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from proctable import run_in_session

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _run(cmd: list[str], timeout: float = 180) -> tuple[int, str]:
    return run_in_session(cmd, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_workers_run_the_demo_and_rank_0_reports(tmp_path):
    """torchrun --nproc-per-node 2 -m miles_fsm demo: every cycle verified, rank 0 prints the report, exit 0,
    and replay of the traces says OK."""
    code, out = _run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "miles_fsm", "demo",
                      "--steps", "2", "--trace-dir", str(tmp_path)])  # fmt: skip
    assert code == 0, out
    assert "OK: 4 cycles verified bit-exact" in out
    assert subprocess.run([str(BIN / "miles-fsm"), "replay", str(tmp_path)]).returncode == 0


def test_torchrun_demo_names_the_culprit_of_a_divergence(tmp_path):
    """An injected divergence under torchrun: the run fails, rank 0's report names rank 1."""
    code, out = _run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "3", "-m", "miles_fsm", "demo",
                      "--steps", "2", "--trace-dir", str(tmp_path), "--inject", "diverge:1:2",
                      "--guard-timeout", "3"])  # fmt: skip
    assert code != 0
    assert "culprit: rank 1" in out, out


def test_ray_launcher_runs_the_demo(tmp_path):
    """miles-fsm demo --launcher ray: 2 ranks as Ray actors, every cycle verified bit-exact, exit 0."""
    pytest.importorskip("ray")
    code, out = _run([str(BIN / "miles-fsm"), "demo", "--launcher", "ray", "--steps", "2", "--trace-dir",
                      str(tmp_path)])  # fmt: skip
    assert code == 0, out
    assert "OK: 4 cycles verified bit-exact" in out


def test_the_megatron_demo_runs_real_megatron_core_bit_exact(tmp_path):
    """miles-fsm demo --trainer megatron: megatron-core DDP + distributed optimizer on CPU gloo, both strategies,
    every cycle verified bit-exact."""
    pytest.importorskip("megatron.core")
    for mode in ("rematerialize", "backup"):
        code, out = _run([str(BIN / "miles-fsm"), "demo", "--trainer", "megatron", "--mode", mode, "--steps", "2",
                          "--trace-dir", str(tmp_path / mode)])  # fmt: skip
        assert code == 0, out
        assert "OK: 4 cycles verified bit-exact" in out


def test_the_megatron_demo_refuses_injections(tmp_path):
    """--inject with --trainer megatron is a one-line usage error, exit 2, before any process starts."""
    code, out = _run([str(BIN / "miles-fsm"), "demo", "--trainer", "megatron", "--inject", "crash:0:1",
                      "--trace-dir", str(tmp_path)])  # fmt: skip
    assert code == 2 and "--inject runs with --trainer reference only" in out
