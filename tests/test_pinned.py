"""Persistent host copies (``drivers/pinned.py``) and the Megatron driver's own optimizer offload.

The copies run on CPU here (plain memory, ``copy_``); the pinned DMA path is
measured on the GPU host by ``miles-fsm bench``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_cpu import megatron_available
from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
from miles_fsm.drivers.errors import HostCopyMissingError
from miles_fsm.errors import ConfigError
from miles_fsm.launch.local import run_ranks


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g).bfloat16(),
        "b": torch.randn(7, generator=g),
        "i": torch.randint(0, 100, (3, 5), generator=g),
        "empty": torch.empty(0),
        "strided": torch.randn(16, 8, generator=g).t(),
    }


def test_save_then_load_is_bit_exact_and_views_match():
    """A saved set comes back bit-exact into poisoned live tensors, and the held views equal the sources."""
    host = HostCopies()
    live = _tensors()
    want = {n: t.clone() for n, t in live.items()}
    rec = host.save("actor", live)
    assert rec.op == "save" and rec.nbytes == sum(t.numel() * t.element_size() for t in live.values())
    for n, v in host.views("actor").items():
        assert v.shape == want[n].shape and v.dtype == want[n].dtype and torch.equal(v, want[n])
    for t in live.values():
        t.view(torch.uint8).fill_(0xFF) if t.is_contiguous() and t.numel() else t.fill_(-1)
    host.load("actor", live)
    for n, t in live.items():
        assert torch.equal(t, want[n]), n


def test_buffers_are_reused_across_cycles_and_reallocated_only_on_a_new_layout():
    """Saving the same layout again allocates nothing; a changed shape allocates one new buffer."""
    host = HostCopies(config=PinnedConfig(align=256))
    for seed in range(5):
        host.save("optimizer_state", _tensors(seed))
    assert host.allocations == 1
    assert host.host_bytes("optimizer_state") <= host.reserved_bytes("optimizer_state")
    assert host.pinned_bytes() == 0  # no CUDA source: nothing pinned
    changed = _tensors()
    changed["b"] = torch.randn(8)
    host.save("optimizer_state", changed)
    assert host.allocations == 2
    host.drop("optimizer_state")
    assert host.host_bytes() == 0 and "optimizer_state" not in host


def test_load_refuses_missing_or_mismatched_targets():
    """Loading into tensors that lack a held name, or differ in shape or dtype, is refused by name."""
    host = HostCopies()
    host.save("ref", {"a": torch.ones(4), "b": torch.ones(2)})
    with pytest.raises(ConfigError, match="no live tensor for held b"):
        host.load("ref", {"a": torch.zeros(4)})
    with pytest.raises(ConfigError, match="a is \\[5\\]"):
        host.load("ref", {"a": torch.zeros(5), "b": torch.zeros(2)})
    with pytest.raises(HostCopyMissingError):
        host.load("teacher", {})


def test_config_rejects_bad_values_at_once():
    """Every bad PinnedConfig field is reported in one error."""
    with pytest.raises(ConfigError) as info:
        PinnedConfig(chunk_bytes=10, streams=0, align=3)
    assert len(info.value.violations) == 3


def rank_optimizer_offload(ctx):
    """Megatron (CPU) with optimizer_offload="driver": the optimizer state is poisoned while PAUSED
    (as a pause without region backup leaves it) and must come back bit-exact from the driver's copy."""
    from megatron_cpu import apply_cpu_patches, build_tiny_gpt, train_step

    apply_cpu_patches()
    from miles_fsm.config import GuardConfig, LifecycleConfig
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.driver import OPTIMIZER_KEY, MegatronTrainer
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.states.lifecycle import Lifecycle

    saver = CpuMemorySaver()
    gpt = build_tiny_gpt(saver=saver)
    out = {"exact": [], "allocations": [], "pauses": []}
    if ctx.kwargs.get("coalesce"):
        from miles_fsm.drivers.megatron.driver import coalesce_optimizer_state

        train_step(gpt, step=100)  # Adam's state exists after a step
        flat = []
        out["flat_bytes"] = coalesce_optimizer_state(
            gpt.optimizer, lambda n: flat.append(torch.empty(n, dtype=torch.uint8)) or flat[-1]
        )
        out["flat_ptr"] = flat[0].untyped_storage().data_ptr()
    config = MegatronDriverConfig.from_megatron(
        gpt.chunks, gpt.optimizer, strategy=ctx.kwargs["strategy"], ci=True, optimizer_offload="driver"
    )
    driver = MegatronTrainer(chunks=gpt.chunks, optimizer=gpt.optimizer, config=config, memory=_Recording(saver, out))
    if ctx.kwargs.get("stale"):
        # The early save that the pause of grad_buffer starts must not outlive a resume.
        train_step(gpt, step=0)
        driver.pause_memory("grad_buffer")
        driver.resume_memory("grad_buffer")
        train_step(gpt, step=1)
        want = digest_tensors(driver.optimizer_state())
        driver.pause_memory("grad_buffer")
        driver.pause_memory("default")
        for t in driver.optimizer_state().values():
            t.fill_(0xFF)
        driver.resume_memory("default")
        driver.resume_memory("grad_buffer")
        return {"exact": digest_tensors(driver.optimizer_state()) == want, "pauses": out["pauses"]}
    lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=30), verify=config.verify))
    lc.start()
    buffers = {b.untyped_storage().data_ptr() for c in gpt.chunks for buf in c.buffers
               for b in (buf.param_data, buf.grad_data)}
    for step in range(2):
        train_step(gpt, step=step)
        state = driver.optimizer_state()
        before = digest_tensors(state)
        lc.offload()
        lc.pause()
        for t in driver.optimizer_state().values():
            t.fill_(0xFF)
        lc.rematerialize()
        lc.sync()
        lc.resume()
        out["exact"].append(digest_tensors(driver.optimizer_state()) == before)
        out["allocations"].append(driver.host_copies.allocations)
    state = driver.optimizer_state()
    out["storages"] = sorted({t.untyped_storage().data_ptr() for t in state.values()})
    if not ctx.kwargs.get("coalesce"):
        # A replaced state tensor (as load_state_dict does) is seen, not served from the cached views.
        inner = gpt.optimizer.chained_optimizers[0].optimizer
        p0 = inner.param_groups[0]["params"][0]
        old_ptr = state["opt0.state.0.0.exp_avg"].data_ptr()
        inner.state[p0]["exp_avg"] = inner.state[p0]["exp_avg"].clone()
        out["cache_refreshed"] = driver.optimizer_state()["opt0.state.0.0.exp_avg"].data_ptr() != old_ptr
    out["names"] = sorted({n.split(".")[1] for n in state})
    out["in_ddp_buffers"] = sum(t.untyped_storage().data_ptr() in buffers for t in state.values())
    out["held"] = driver.host_bytes(OPTIMIZER_KEY)
    out["state_bytes"] = sum(t.numel() for t in state.values())
    out["held_key"] = driver.host_copies.host_bytes(OPTIMIZER_KEY)
    lc.close()
    return out


class _Recording:
    """A memory saver that records each pause and whether it synchronized."""

    def __init__(self, saver, out):
        self._saver, self._out = saver, out

    def pause(self, tag, *, synchronize=True):
        self._out["pauses"].append((tag, synchronize))
        self._saver.pause(tag, synchronize=synchronize)

    def resume(self, tag):
        self._saver.resume(tag)


_SKIP = megatron_available()


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_megatron_driver_keeps_the_optimizer_state_itself(assert_no_leftovers):
    """With optimizer_offload="driver", poisoned optimizer state comes back bit-exact each cycle, the
    host buffers are allocated in the first cycle only, and no DDP-buffer storage is copied."""
    outcomes = run_ranks(rank_optimizer_offload, 1, timeout_s=120, kwargs={"strategy": "rematerialize"})
    o = outcomes[0]
    assert o.ok, o.error.traceback if o.error else o.exitcode
    r = o.result
    assert r["exact"] == [True, True]
    # extras (actor) + optimizer state: two buffers, none added by the second cycle.
    assert r["allocations"][0] == r["allocations"][1] >= 1
    assert {"shard_fp32_from_float16_groups", "state"} <= set(r["names"])
    assert r["in_ddp_buffers"] == 0
    assert r["cache_refreshed"] is True
    assert r["held"] == r["held_key"] == r["state_bytes"] > 0
    # Each offload starts the optimizer state's copy at the pause of grad_buffer and unmaps that tag
    # while it runs (no device sync); default is unmapped after the copy, with the usual sync.
    offloads = [p for p in r["pauses"] if p[0] in ("grad_buffer", "default")]
    assert offloads == [("grad_buffer", False), ("default", True)] * 2


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_an_early_optimizer_save_is_dropped_by_a_resume(assert_no_leftovers):
    """grad_buffer paused then resumed, a train step, then the real offload: the state that comes
    back is the one after that step, not the copy the first pause started."""
    outcomes = run_ranks(rank_optimizer_offload, 1, timeout_s=120, kwargs={"strategy": "backup", "stale": True})
    o = outcomes[0]
    assert o.ok, o.error.traceback if o.error else o.exitcode
    assert o.result["exact"] is True
    assert o.result["pauses"] == [("grad_buffer", False), ("grad_buffer", False), ("default", True)]


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_coalesced_optimizer_state_is_one_storage_and_still_trains(assert_no_leftovers):
    """coalesce_optimizer_state moves the master shards and Adam moments into one allocation: training
    goes on (the optimizer steps through the moved tensors), and the driver's copy is that one storage."""
    outcomes = run_ranks(
        rank_optimizer_offload, 1, timeout_s=120, kwargs={"strategy": "backup", "coalesce": True}
    )
    o = outcomes[0]
    assert o.ok, o.error.traceback if o.error else o.exitcode
    r = o.result
    assert r["exact"] == [True, True]
    assert r["flat_ptr"] in r["storages"]
    flat_share = r["flat_bytes"] / r["state_bytes"]
    assert flat_share > 0.99, flat_share  # the rest: small tensor attributes of the optimizer objects


def test_driver_offload_turns_off_the_default_region_backup():
    """optimizer_offload="driver" means `default` is allocated without a region backup; a bad value is refused."""
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig

    tags = {t.tag: t.cpu_backup for t in MegatronDriverConfig(optimizer_offload="driver").tag_memory}
    assert tags == {"grad_buffer": False, "default": False, "param_buffer": False}
    with pytest.raises(ConfigError, match="optimizer_offload"):
        MegatronDriverConfig(optimizer_offload="disk")
