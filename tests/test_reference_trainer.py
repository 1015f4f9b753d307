"""The reference trainer: both weight strategies through the Lifecycle, bit-exact, and what verification catches."""

from __future__ import annotations

import pytest
import torch

from miles_fsm import GuardConfig, Lifecycle, LifecycleConfig, Strategy, VerifyConfig
from miles_fsm.digest import digest_tensors
from miles_fsm.states import TrainerDriver
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.trainer import ReferenceTrainer, TrainerConfig
from miles_fsm.drivers.reference.model import EXTRA_BUFFERS, EXTRA_PARAMS
from miles_fsm.drivers.reference.engine import ReferenceEngine
from miles_fsm.drivers.errors import IneligibleModelError
from miles_fsm.errors import ConfigError, MemoryReleasedError
from miles_fsm.states.errors import VerificationError
from miles_fsm.guard.consensus import Guard
from miles_fsm.launch.local import RankContext, run_ranks


def _stack(strategy: Strategy, *, trainer_cls: type = ReferenceTrainer, guard: Guard | None = None):
    saver = CpuMemorySaver()
    trainer = trainer_cls(config=TrainerConfig(strategy=strategy), saver=saver)
    engine = ReferenceEngine(saver=saver)
    lc = Lifecycle(
        trainer=trainer,
        engine=engine,
        config=LifecycleConfig(verify=VerifyConfig(cycles=None), guard=GuardConfig(timeout_s=10.0)),
        guard=guard or Guard.solo(),
    )
    return trainer, engine, lc


def _cycle(lc: Lifecycle, trainer: ReferenceTrainer, engine: ReferenceEngine, step: int) -> None:
    lc.offload()
    lc.pause()
    prompts = torch.randint(0, 64, (4, 4), generator=torch.Generator().manual_seed(step))
    rollouts = engine.generate(prompts, max_new_tokens=8)
    lc.rematerialize()
    lc.sync()
    lc.resume()
    reward = (rollouts[:, 4:] % 2 == 0).float().sum(1)
    trainer.train_step(rollouts, reward - reward.mean(), prompt_len=4)


@pytest.mark.parametrize("strategy", list(Strategy))
def test_every_cycle_is_bit_exact_and_the_engine_serves_the_trainers_weights(strategy):
    """After each cycle the tensors equal their pre-offload bytes, and the engine's weights hash like the trainer's."""
    trainer, engine, lc = _stack(strategy)
    lc.start()
    for step in range(3):
        before = digest_tensors(trainer.tensors())
        weights = digest_tensors(dict(trainer.named_weights()))
        lc.offload()
        with pytest.raises(MemoryReleasedError):
            trainer.tensors()  # the optimizer state is released: no view of freed memory is handed out
        lc.pause()
        assert engine.weight_digests() == weights
        engine.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2)
        lc.rematerialize()
        lc.sync()
        lc.resume()
        assert digest_tensors(trainer.tensors()) == before
        trainer.train_step(torch.randint(0, 64, (2, 8)), torch.zeros(2), prompt_len=4)
        assert digest_tensors(trainer.tensors()) != before, "training must change the weights"


def test_reference_trainer_implements_the_trainer_driver_protocol():
    """ReferenceTrainer is a TrainerDriver."""
    assert isinstance(ReferenceTrainer(), TrainerDriver)


def test_rematerialize_keeps_no_host_copy_of_the_bf16_params():
    """Under rematerialize the actor's host copy holds only the extras; under backup it holds every weight."""
    remat, _, lc = _stack(Strategy.REMATERIALIZE)
    lc.start()
    lc.offload()
    held = remat.get("actor")
    assert set(held) == set(EXTRA_PARAMS) | set(EXTRA_BUFFERS)
    assert remat.host_bf16_param_bytes() == 0
    assert remat.backup_host_bytes("actor") == sum(t.numel() * t.element_size() for t in held.values())
    assert remat.backup_host_bytes("ref") > remat.backup_host_bytes("actor")  # ref always keeps a full copy

    full, _, lc = _stack(Strategy.BACKUP)
    lc.start()
    lc.offload()
    assert set(full.get("actor")) == set(full.weights())
    assert full.host_bf16_param_bytes() == sum(t.numel() * 2 for t in full.params.values())


def test_bf16_params_are_views_into_one_flat_buffer():
    """Every bf16 param shares the single flat param buffer's storage."""
    trainer = ReferenceTrainer()
    ptr = trainer.flat.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == ptr for p in trainer.params.values())
    assert all(p.dtype == torch.bfloat16 for p in trainer.params.values())


def test_rematerialize_refuses_frozen_params_at_init_and_names_them():
    """A param outside the flat buffer and not among the extras cannot be rebuilt: refused at init, by name."""
    with pytest.raises(IneligibleModelError, match="pos.weight"):
        ReferenceTrainer(config=TrainerConfig(frozen=frozenset({"pos.weight"})))
    trainer = ReferenceTrainer(config=TrainerConfig(frozen=frozenset({"pos.weight"}), strategy=Strategy.BACKUP))
    assert "pos.weight" in trainer.tensor_set().names


def test_copy_between_tags():
    """copy(src, dst) duplicates a full host copy; copying the partial rematerialize actor copy is refused."""
    trainer = ReferenceTrainer(config=TrainerConfig(strategy=Strategy.BACKUP))
    trainer.backup("actor")
    trainer.copy("actor", "old_actor")
    assert digest_tensors(trainer.get("old_actor")) == digest_tensors(trainer.get("actor"))
    remat = ReferenceTrainer()
    remat.backup("actor")
    with pytest.raises(ConfigError, match="keep_old_actor"):
        remat.copy("actor", "old_actor")


class SkipCast(ReferenceTrainer):
    def cast_main_to_params(self):
        return None


class SkipSync(ReferenceTrainer):
    def param_sync(self):
        return None


def _skip_rank(ctx: RankContext) -> dict[str, object]:
    """Three lifecycles on each rank: honest, then with the cast or the sync skipped."""
    out: dict[str, object] = {}
    for label, cls in (("honest", ReferenceTrainer), ("skip_cast", SkipCast), ("skip_sync", SkipSync)):
        guard = Guard.from_default_group(timeout_s=10.0)
        trainer, engine, lc = _stack(Strategy.REMATERIALIZE, trainer_cls=cls, guard=guard)
        lc.start()
        try:
            _cycle(lc, trainer, engine, 1)
            _cycle(lc, trainer, engine, 2)
            out[label] = None
        except VerificationError as exc:
            out[label] = sorted(exc.mismatched)
    return out


@pytest.mark.slow
def test_skipping_the_cast_or_the_param_sync_is_caught_by_verification(assert_no_leftovers):
    """On 2 ranks, a trainer that skips cast_main_to_params or param_sync fails verification; the honest one passes."""
    outcomes = run_ranks(_skip_rank, 2, timeout_s=60)
    for o in outcomes:
        assert o.ok, o.error
        assert o.result["honest"] is None
        # Skipping the cast leaves this rank's own shard poisoned; skipping the sync leaves the other's.
        assert o.result["skip_cast"], f"rank {o.rank}: skipped cast went unnoticed"
        assert o.result["skip_sync"], f"rank {o.rank}: skipped sync went unnoticed"


def test_reads_of_released_memory_are_refused_not_crashes():
    """In PAUSED, backup(), weights() and optimizer reads raise MemoryReleasedError (they used to segfault),
    and a host copy never taken is a HostCopyMissingError naming what is held."""
    from miles_fsm.drivers.errors import HostCopyMissingError

    lc = Lifecycle(trainer=(trainer := ReferenceTrainer()))
    lc.start()
    lc.offload()
    lc.pause()
    for read in (lambda: trainer.backup("actor"), trainer.weights, trainer.optimizer_state, trainer.tensors):
        with pytest.raises(MemoryReleasedError, match="are not usable"):
            read()
    with pytest.raises(HostCopyMissingError, match="'teacher'"):
        trainer.restore("teacher")
    with pytest.raises(HostCopyMissingError):
        trainer.copy("teacher", "old_actor")
    lc.rematerialize(), lc.sync(), lc.resume()
    assert trainer.weights() and trainer.optimizer_state()
