"""The Megatron driver on a real GPU with torch_memory_saver (run on the GPU host: ``pytest -m gpu``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_MISSING = [m for m in ("megatron.core", "torch_memory_saver") if importlib.util.find_spec(m.split(".")[0]) is None]


@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} installed")
def test_gpu_cycles_bit_exact_and_memory_freed(tmp_path):
    """On one GPU, a >= 1.5 B GPT runs full cycles with both strategies, bit-exact every cycle,
    and PAUSED frees at least the param and grad buffers (measured with mem_get_info)."""
    out = tmp_path / "gpu_megatron.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_megatron.py"), "--out", str(out), "--cycles", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["model"]["params"] >= 1.5e9
    for strategy in ("rematerialize", "backup"):
        data = result["strategies"][strategy]
        assert data["state"] == "TRAINING"
        assert all(c["exact"] for c in data["cycles"])
        buffers = data["param_buffer_bytes"] + data["grad_buffer_bytes"]
        assert all(c["freed_in_paused_bytes"] >= 0.9 * buffers for c in data["cycles"])
    remat = result["strategies"]["rematerialize"]["cycles"][-1]
    backup = result["strategies"]["backup"]["cycles"][-1]
    assert remat["actor_host_bytes"] < backup["actor_host_bytes"] / 100
