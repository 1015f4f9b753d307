"""The lifecycle on one rank: transitions, failure, recovery, verification, snapshot."""

from __future__ import annotations

import pytest

from miles_fsm import (
    ConfigError,
    GuardConfig,
    Lifecycle,
    LifecycleConfig,
    RecoveryError,
    State,
    Strategy,
    TransitionNotAllowed,
    VerificationError,
    VerifyConfig,
)
from miles_fsm.states import Side
from miles_fsm.states.errors import MemoryTagError, TensorSetChangedError, WeightVersionError
from toy import ToyEngine, ToyTrainer

CYCLE = ("offload", "pause", "rematerialize", "sync", "resume")


def make(strategy=Strategy.REMATERIALIZE, verify_cycles=None, engine=True):
    trainer = ToyTrainer(strategy=strategy)
    eng = ToyEngine() if engine else None
    lc = Lifecycle(trainer=trainer, engine=eng, config=LifecycleConfig(verify=VerifyConfig(cycles=verify_cycles)))
    return lc, trainer, eng


@pytest.mark.parametrize("strategy", list(Strategy))
def test_full_cycles_restore_bit_exact(strategy):
    """Both strategies bring the params back bit-exact, and the engine serves the trainer's weights."""
    lc, trainer, engine = make(strategy)
    lc.start()
    before = trainer.params["w"].clone()
    for _ in range(3):
        for t in CYCLE:
            lc.fire(t)
    assert lc.state is State.TRAINING and lc.epoch == 3
    assert trainer.params["w"].equal(before)
    assert engine.weights["w"].equal(before) and engine.version == "3"


def test_illegal_trigger_raises_and_changes_nothing():
    """TransitionNotAllowed keeps state and trigger as attributes, lists what is allowed, runs nothing."""
    lc, trainer, _ = make()
    lc.start()
    calls = list(trainer.calls)
    with pytest.raises(TransitionNotAllowed) as info:
        lc.pause()
    assert (info.value.state, info.value.trigger, info.value.allowed) == ("TRAINING", "pause", ("offload",))
    assert lc.state is State.TRAINING and trainer.calls == calls


def test_failed_rank_refuses_until_recovered():
    """A failing step lands in FAILED; every trigger is refused with the cause until recover()."""
    lc, trainer, _ = make()
    lc.start()
    lc.offload()
    lc.pause()
    trainer.fail_on = "resume:grad_buffer"
    with pytest.raises(RuntimeError, match="injected"):
        lc.rematerialize()
    assert lc.state is State.FAILED
    assert lc.failure.step == "resume_memory(param_buffer,grad_buffer,default)"
    with pytest.raises(TransitionNotAllowed, match="FAILED earlier"):
        lc.sync()
    # param_buffer came back, grad_buffer/default did not: TRAINING is impossible, PAUSED is safe.
    with pytest.raises(RecoveryError, match="released and their contents are gone"):
        lc.recover(State.TRAINING)
    trainer.fail_on = None
    lc.recover(State.PAUSED)
    assert lc.state is State.PAUSED
    assert lc.paused_tags[Side.TRAINER] == State.PAUSED.trainer_paused_tags
    for t in ("rematerialize", "sync", "resume"):
        lc.fire(t)
    assert lc.state is State.TRAINING


def test_recover_only_from_failed():
    """recover() is refused on a healthy rank, and to INITIAL."""
    lc, _, _ = make()
    with pytest.raises(RecoveryError, match="not FAILED"):
        lc.recover(State.TRAINING)


def test_memory_ledger_refuses_double_pause_without_calling_driver():
    """The ledger in front of the driver refuses a pause of a paused tag and a resume of an active one."""
    lc, trainer, _ = make()
    lc.start()
    lc.offload()
    ledger = lc._actions.memory[Side.TRAINER]
    n = len(trainer.calls)
    with pytest.raises(MemoryTagError) as info:
        ledger.pause(["param_buffer", "grad_buffer"])
    assert info.value.tag == "grad_buffer" and info.value.op == "pause"
    with pytest.raises(MemoryTagError, match="not paused"):
        ledger.resume(["param_buffer"])
    assert len(trainer.calls) == n  # param_buffer was not paused either: the request is refused whole


def test_skipped_cast_is_caught_by_verification():
    """If the cast does nothing, the NaN-poisoned params fail SHA256 verification, naming the tensor."""
    lc, trainer, _ = make()
    trainer.cast_main_to_params = lambda: None
    lc.start()
    for t in CYCLE[:-1]:
        lc.fire(t)
    with pytest.raises(VerificationError) as info:
        lc.resume()
    assert info.value.mismatched == ("w",)
    assert lc.state is State.FAILED


def test_changed_tensor_set_is_its_own_error():
    """A tensor that appears between offload and verify raises TensorSetChangedError naming it."""
    import torch

    lc, trainer, _ = make()
    lc.start()
    for t in CYCLE[:-1]:
        lc.fire(t)
    trainer.params["extra"] = torch.zeros(2)
    with pytest.raises(TensorSetChangedError) as info:
        lc.resume()
    assert info.value.added == ("extra",) and info.value.removed == ()


def test_verification_runs_only_on_configured_cycles(monkeypatch):
    """cycles=1 verifies the first cycle only; CI=true turns it on for every cycle."""
    monkeypatch.delenv("CI", raising=False)
    lc, trainer, _ = make(verify_cycles=1)
    assert lc.verifies(1) and not lc.verifies(2)
    monkeypatch.setenv("CI", "true")
    assert lc.verifies(2)
    # A benchmark that must time unverified cycles opts out of the CI override.
    bench = Lifecycle(
        trainer=ToyTrainer(), config=LifecycleConfig(verify=VerifyConfig(cycles=1, ci_verifies_every_cycle=False))
    )
    assert bench.verifies(1) and not bench.verifies(2)


def test_engine_version_mismatch_is_detected():
    """An engine that reports another version than the one pushed fails the push."""
    lc, _, engine = make()
    engine.weight_version = lambda: "stale"
    lc.start()
    lc.offload()
    with pytest.raises(WeightVersionError) as info:
        lc.pause()
    assert (info.value.expected, info.value.actual) == ("1", "stale")


def test_engine_weights_differing_from_trainer_fail_verification():
    """An engine that serves other bytes than were pushed fails verification, naming the engine."""
    import torch

    lc, _, engine = make()
    original = engine.update_weights

    def lossy(named, *, version):
        original([(k, torch.zeros_like(v) if k == "b" else v) for k, v in named], version=version)

    engine.update_weights = lossy
    lc.start()
    lc.offload()
    lc._trainer.params["b"].fill_(1)  # so that the engine's zeroed copy differs
    with pytest.raises(VerificationError) as info:
        lc.pause()
    assert info.value.where == "engine toy-engine" and info.value.mismatched == ("b",)


def test_without_engine_trainer_steps_still_run():
    """A rank without an engine skips engine steps and the push."""
    lc, trainer, _ = make(engine=False)
    lc.start()
    for t in CYCLE:
        lc.fire(t)
    assert lc.state is State.TRAINING
    assert lc.paused_tags[Side.ENGINE] == frozenset()


def test_snapshot_reports_state_and_tags():
    """snapshot() is a frozen view: state, epoch, paused tags, nothing in flight between transitions."""
    lc, _, _ = make()
    lc.start()
    lc.offload()
    snap = lc.snapshot()
    assert (snap.state, snap.epoch, snap.in_flight) == (State.OFFLOADED, 1, None)
    assert snap.trainer_paused == {"grad_buffer", "default"}
    assert snap.engine_released == {"weights", "kv_cache"}
    with pytest.raises(AttributeError):
        snap.state = State.PAUSED  # type: ignore[misc]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), 1e12])
def test_guard_timeouts_must_be_finite_positive_and_at_most_a_day(bad):
    """GuardConfig refuses a timeout that is not a real wait (0, negative, inf, NaN, 1e12 s), per trigger too."""
    with pytest.raises(ConfigError, match="must be > 0 and <= 86400"):
        GuardConfig(timeout_s=bad)
    with pytest.raises(ConfigError, match=r"timeouts\['sync'\]"):
        GuardConfig(timeouts={"sync": bad})


def test_every_transition_is_guarded_by_default_and_the_opt_out_guards_only_collectives(tmp_path):
    """With a world > 1 every transition writes a guard record; every_transition=False guards only
    those whose plan declares a collective. (World 1 here: the planner's choice is read off the plan.)"""
    from miles_fsm.guard.consensus import Guard

    class Two(Guard):  # a guard that says it has peers, and agrees with itself
        def agree(self, intent, *, state, timeout_s=None):
            self.seen.append(intent.trigger)

    for every, expected in ((True, ["start", "offload", "pause", "rematerialize", "sync", "resume"]), (False, [])):
        guard = Two(rank=0, world=2, group=None, store=_NullStore(), timeout_s=5.0)
        guard.seen = []
        lc = Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(),
                       config=LifecycleConfig(guard=GuardConfig(every_transition=every), run_id="r"), guard=guard)
        lc.start()
        lc.offload(), lc.pause(), lc.rematerialize(), lc.sync(), lc.resume()
        assert guard.seen == expected  # the toy declares its all-gather only with a real world > 1


class _NullStore:
    def set(self, key, value):
        pass
