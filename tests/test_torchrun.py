"""Trainer ranks as torchrun workers: verified cycles, and the failing ranks' typed errors on disk."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import orjson
import pytest
from proctable import run_in_session

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("torchrun_worker.py")
#: torchrun itself (its console script is ``torch.distributed.run``'s main), whether or not its script is on PATH.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _torchrun(tmp_path: Path, **kwargs) -> tuple[int, dict[int, dict]]:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
           str(WORKER), str(tmp_path), json.dumps(kwargs)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, _ = run_in_session(cmd, timeout=120, env=env)
    records = {}
    for r in range(2):
        for kind in ("result", "error"):
            f = tmp_path / f"rank-{r}.{kind}.json"
            if f.exists():
                records[r] = {"kind": kind, **orjson.loads(f.read_bytes())}
    return code, records


def test_two_torchrun_workers_run_verified_cycles(tmp_path):
    """2 workers under torchrun run 2 verified cycles and end in TRAINING with identical params."""
    code, records = _torchrun(tmp_path)
    assert code == 0, records
    assert [records[r]["state"] for r in range(2)] == ["TRAINING", "TRAINING"]
    assert records[0]["w"] == records[1]["w"]


def test_a_divergence_leaves_each_workers_typed_error_with_its_fields(tmp_path):
    """Rank 1 plans another tensor set: torchrun exits non-zero and each worker's error file names
    RankDivergenceError with its fields (the field, the suspects, how they were found)."""
    code, records = _torchrun(tmp_path, frozen_rank=1)
    assert code != 0
    for r in range(2):
        rec = records[r]
        assert rec["kind"] == "error" and rec["error"] == "RankDivergenceError", rec
        assert rec["fields"]["field"] == "tensor set" and rec["fields"]["culprits"] == [0, 1]


def test_a_hang_is_named_by_the_survivor(tmp_path):
    """Rank 1 hangs before its sync guard: rank 0's error file holds GuardTimeoutError naming rank 1, and
    torchrun's agent tears the hung worker down (the run ends, non-zero)."""
    code, records = _torchrun(tmp_path, hang_rank=1)
    assert code != 0
    assert records[0]["error"] == "GuardTimeoutError" and records[0]["fields"]["missing"] == [1]
    assert 1 not in records


def _root_cause(output: str) -> str:
    """The rank line of torchrun's own summary under "Root Cause (first observed failure)"."""
    section = output.split("Root Cause (first observed failure):", 1)[1]
    return next(line.split(":", 1)[1].strip() for line in section.splitlines() if line.strip().startswith("rank "))


def test_torchruns_own_summary_names_the_hung_rank_as_the_root_cause(tmp_path):
    """Rank 1 hangs; rank 0 times out naming it, and torchrun's agent then stops rank 1. torchrun's summary
    named rank 0 as the root cause (no worker wrote torch elastic's error file, so the first failure it
    observed won). The survivor now publishes whom it named, and the named rank writes its error file when
    the agent stops it, dated when it stopped answering: torchrun's summary names rank 1, with rank 0's
    error (its own error file) among the other failures."""
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
           str(WORKER), str(tmp_path), json.dumps({"hang_rank": 1})]  # fmt: skip
    code, output = run_in_session(cmd, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert code != 0
    assert _root_cause(output).startswith("1 (local_rank: 1)"), output
    cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert "rank 1 stopped answering: rank 0 named it the culprit (GuardTimeoutError" in cause, cause
    assert "time.sleep(3600)" in cause, cause  # where it hung
    assert "did not reach the guard" in output and "GuardTimeoutError" in output, output
