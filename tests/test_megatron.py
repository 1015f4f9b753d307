"""The Megatron driver on real megatron-core 0.16.1: CPU, gloo, two ranks.

A tiny GPT from the local layer spec, bf16 through ``Float16Module``, DDP
with the distributed optimizer, real train steps between cycles. The CPU
patches megatron needs live in ``tests/megatron_cpu.py`` only.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cpu import megatron_available, rank_full_cycles, rank_structure_and_divergence
from miles_fsm.launch import run_ranks

_SKIP = megatron_available()
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _full_cycles(strategy: str) -> tuple:
    """One 2-rank run per strategy, shared by the tests that read it (each run costs seconds)."""
    return tuple(_results(run_ranks(rank_full_cycles, 2, timeout_s=120, kwargs={"strategy": strategy})))


def _results(outcomes):
    for o in outcomes:
        assert o.ok, f"rank {o.rank} failed: {o.error.traceback if o.error else f'exit code {o.exitcode}'}"
    return [o.result for o in outcomes]


@pytest.mark.parametrize("strategy", ["rematerialize", "backup"])
def test_full_cycles_are_bit_exact(strategy, assert_no_leftovers):
    """Three train/offload/pause/rematerialize/sync/resume cycles per strategy, SHA256-verified
    by the lifecycle every cycle (CI mode) and checked again here; the DDP param and grad
    buffers hold no memory while PAUSED, and the plan reads no pause state."""
    results = _full_cycles(strategy)
    for r in results:
        assert r["strategy"] == strategy
        assert r["state"] == "TRAINING"
        assert [c["epoch"] for c in r["cycles"]] == [1, 2, 3]
        assert all(c["exact"] for c in r["cycles"]), r["cycles"]
        assert r["paused_resident"] == [0, 0, 0]
        assert r["resident_training"] > 0
        assert r["plan_same_when_paused"] == [True, True, True]
        assert r["old_actor_exact"] == [True, True, True]
        # One all-gather per bucket: the bf16 buffer and the fp32 extras' buffer.
        assert [c.split("[")[0] for c in r["collectives"]] == ["all_gather@chunk0.dp.bg0", "all_gather@chunk0.dp.bg1"]
    # Both ranks trained on different data, yet hold identical params after the sync.
    assert results[0]["cycles"] == results[1]["cycles"]


def test_rematerialize_keeps_only_extras_and_a_skipped_cast_is_caught(assert_no_leftovers):
    """Rematerialize's actor host copy is the fp32 extras only (512 bytes here, not the
    model), old_actor is still a full copy, a copy while PAUSED is refused, and a cycle that
    skips the cast fails verification naming the poisoned bf16 params."""
    results = _full_cycles("rematerialize")
    for r in results:
        assert r["actor_host_bytes"] == 2 * 64 * 4  # extra_scale + expert_bias, fp32
        assert r["model_bytes"] > 100 * r["actor_host_bytes"]
        assert r["copy_refused_when_paused"] == ("param_buffer",)
        assert r["no_cast_caught"] >= 20


def test_structure_refusals_and_divergence_caught_before_all_gather(assert_no_leftovers):
    """A frozen param is refused at construction by name; a config that contradicts the
    megatron objects lists every contradiction; and when rank 1's tensor set differs, the
    SYNC guard fails on both ranks before either enters start_param_sync."""
    results = _results(run_ranks(rank_structure_and_divergence, 2, timeout_s=120))
    for rank, r in enumerate(results):
        assert r["ineligible"] == ["module.decoder.final_layernorm.weight"]
        assert "frozen" in r["ineligible_message"]
        assert r["extra_param_backed_up"] is True
        assert r["backup_accepts_frozen"] == "backup"
        assert len(r["mismatch_violations"]) == 3
        assert r["syncs_after_healthy_cycle"][0] >= 1
        assert r["divergence"]["field"] == "tensor set"
        assert sorted(r["divergence"]["groups"].values()) == [[0], [1]]
        assert r["syncs_after_divergence"] == r["syncs_before_divergent_cycle"], f"rank {rank} entered the all-gather"
        assert r["state"] == "FAILED"


def test_cpu_patches_stay_in_test_code():
    """Importing the driver patches nothing in torch; the patch code exists only under tests/."""
    code = (
        "import torch, miles_fsm.drivers.megatron as m, miles_fsm.drivers.megatron_config;"
        "from torch.overrides import _get_current_function_mode_stack as s;"
        "f = torch.cuda.current_device; g = torch.cuda.get_rng_state;"
        "assert f.__module__ == 'torch.cuda', f; assert g.__module__.startswith('torch.cuda'), g;"
        "assert not s(), s()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for folder in ("drivers", "miles_fsm", "states"):
        for path in (ROOT / folder).glob("*.py"):
            text = path.read_text()
            for marker in ("torch.cuda.current_device =", "_set_cuda_rng_state =", "torch.cuda.manual_seed ="):
                assert marker not in text, f"{path} carries a CPU test patch ({marker})"
