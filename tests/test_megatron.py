"""The Megatron driver on real megatron-core 0.16.1: CPU, gloo, two ranks.

A tiny GPT from the local layer spec, bf16 through ``Float16Module``, DDP
with the distributed optimizer, real train steps between cycles. megatron
runs on CPU through the shipped opt-in, ``miles_fsm.drivers.megatron.cpu``;
the tests patch nothing themselves.
"""

from __future__ import annotations

import functools

import pytest

from megatron_cpu import megatron_available, rank_demo_cycles, rank_full_cycles, rank_structure_and_divergence
from miles_fsm.launch.local import run_ranks

_SKIP = megatron_available()
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]


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
        assert r["paused_resident"] == [0, 0, 0]  # param_buffer, grad_buffer and default (optimizer state)
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
    """A frozen param is refused at construction by name (and makes the params' tags unknown); a config that contradicts the
    megatron objects lists every contradiction; and when rank 1's tensor set differs, the
    SYNC guard fails on both ranks before either enters start_param_sync."""
    results = _results(run_ranks(rank_structure_and_divergence, 2, timeout_s=120))
    for rank, r in enumerate(results):
        assert r["ineligible"] == ["module.decoder.final_layernorm.weight"]
        assert "frozen" in r["ineligible_message"]
        assert r["ineligible_suggestions"][0].startswith("frozen (requires_grad=False): DDP skips it")
        assert "did you mean 'module.decoder.final_layernorm.weight'" in " ".join(r["misnamed_extra"])
        assert r["extra_param_backed_up"] is True
        assert r["backup_accepts_frozen"] == "backup"
        # Only a model whose every tensor lies in a DDP param buffer lets the verification's
        # record pass overlap pauses of other tags; a frozen param or a module buffer joins first.
        assert r["verified_tags"] == {"plain": ["param_buffer"], "frozen": ["unknown"], "with_buffers": ["unknown"]}
        assert len(r["mismatch_violations"]) == 3
        assert r["syncs_after_healthy_cycle"][0] >= 1
        assert r["divergence"]["field"] == "tensor set"
        assert sorted(r["divergence"]["groups"].values()) == [[0], [1]]
        assert r["syncs_after_divergence"] == r["syncs_before_divergent_cycle"], f"rank {rank} entered the all-gather"
        assert r["state"] == "FAILED"


def test_the_demo_loop_runs_bit_exact_in_both_strategies_from_the_shipped_module(assert_no_leftovers):
    """``build_cpu_gpt_trainer`` alone (no test-side patch) runs two train steps behind
    ``agree_on("train", train_collectives())`` and two lifecycle cycles per strategy, every cycle
    verified by the lifecycle and bit-exact; PAUSED holds no trainer memory; and the collectives a
    train step really issues across ranks are exactly the ones it declares, in order."""
    results = _results(run_ranks(rank_demo_cycles, 2, timeout_s=120))
    for r in results:
        for strategy in ("rematerialize", "backup"):
            run = r[strategy]
            assert run["strategy"] == strategy and run["state"] == "TRAINING"
            assert [c["epoch"] for c in run["cycles"]] == [1, 2]
            for c in run["cycles"]:
                assert c["verified"] and c["exact"], c
                assert c["paused_resident"] == 0
                assert c["default_resident"] > 0  # the optimizer state really sits under default
                assert c["train_seen"] == c["train_declared"]
                assert [op for op, _, _ in c["train_declared"]] == [
                    "reduce_scatter", "reduce_scatter", "all_reduce", "all_gather", "all_gather"
                ]  # fmt: skip
    # Different data per rank (so different losses), yet the same params on both after every sync.
    for strategy in ("rematerialize", "backup"):
        mine, theirs = (r[strategy]["cycles"] for r in results)
        assert [c["loss"] for c in mine] != [c["loss"] for c in theirs]
        assert [c["params"] for c in mine] == [c["params"] for c in theirs]
