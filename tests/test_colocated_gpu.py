"""Megatron and SGLang on one GPU through the lifecycle (run on the GPU host: ``pytest -m gpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_MISSING = [m for m in ("sglang", "megatron", "torch_memory_saver", "httpx") if importlib.util.find_spec(m) is None]


@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} installed")
def test_colocated_loop_against_the_real_engine(tmp_path):
    """A 1.1 B megatron GPT and a real SGLang server share the GPU through 3 cycles per strategy and push
    format: SGLang's logprobs match megatron's within bf16's tolerance and move after each train step, both
    wrong conversions fail by the margin, /weights_checker matches every push, every cycle is SHA256-exact,
    PAUSED gives the trainer's tags to the engine, and no server is left running."""
    # MILES_FSM_COLOCATED_OUT: keep the run's JSON (and its server log) there, so one run gives both the
    # test's verdict and benchmarks/results/colocated_h200.json.
    keep = os.environ.get("MILES_FSM_COLOCATED_OUT")
    out = Path(keep) / "colocated_h200.json" if keep else tmp_path / "colocated.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_colocated.py"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1400)  # fmt: skip
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    failed = {k: v for k, v in result["checks"].items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, json.dumps(failed, default=str)[:4000] + proc.stdout[-2000:]
    assert result["model"]["params"] >= 1e9
    assert {(r["strategy"], r["load_format"]) for r in result["runs"]} == {
        (s, f) for s in ("rematerialize", "backup") for f in ("tensors", "flattened_bucket")}  # fmt: skip
    assert all(len(r["cycles"]) == 3 for r in result["runs"])
    assert result["speed"]["device_copy_GBps"] > 0 and all(r["bottleneck"] for r in result["speed"]["runs"])
    assert result["server"]["stopped"]
