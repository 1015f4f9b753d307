"""Recovery never lands a rank on poisoned params, and never skips a pending verification."""

from __future__ import annotations

import pytest
import torch

from miles_fsm import Lifecycle, LifecycleConfig, State, VerifyConfig
from miles_fsm.states.errors import RecoveryError, VerificationError
from toy import ToyEngine, ToyTrainer


def _lc() -> tuple[Lifecycle, ToyTrainer]:
    trainer = ToyTrainer()
    lc = Lifecycle(trainer=trainer, engine=ToyEngine(), config=LifecycleConfig(verify=VerifyConfig(cycles=None)))
    lc.start()
    return lc, trainer


def test_a_cast_that_fails_after_the_resume_cannot_be_recovered_into_training():
    """cast_main_to_params fails with the tags resumed (params are NaN): TRAINING, SYNCED and REMATERIALIZED are
    refused, naming the unbuilt tags; PAUSED is accepted and the next wake verifies bit-exact."""
    lc, trainer = _lc()
    before = trainer.params["w"].clone()
    lc.offload(), lc.pause()
    trainer.fail_on = "cast_main_to_params"
    with pytest.raises(RuntimeError, match="injected"):
        lc.rematerialize()
    assert torch.isnan(trainer.params["w"].float()).all()  # what a recovery to TRAINING would train on
    for target in (State.TRAINING, State.SYNCED, State.REMATERIALIZED):
        with pytest.raises(RecoveryError, match=r"resumed but not rebuilt.*recover to PAUSED"):
            lc.recover(target)
        assert lc.state is State.FAILED
    lc.recover(State.PAUSED)
    trainer.fail_on = None
    lc.rematerialize(), lc.sync(), lc.resume()
    assert torch.equal(trainer.params["w"], before)


def test_a_failed_verification_is_checked_again_after_recovery():
    """After a VerificationError, recover(SYNCED) + resume() verifies again (and fails again on the same bad
    bytes), and recover(TRAINING), which would skip it, is refused."""
    lc, trainer = _lc()
    lc.offload(), lc.pause(), lc.rematerialize(), lc.sync()
    trainer.params["w"][0] += 1  # corrupt after the rebuild: resume must catch it
    with pytest.raises(VerificationError):
        lc.resume()
    with pytest.raises(RecoveryError, match=r"known bad.*verification of epoch 1 is pending"):
        lc.recover(State.TRAINING)
    lc.recover(State.SYNCED)
    with pytest.raises(VerificationError, match="w"):
        lc.resume()


def test_a_failure_that_broke_nothing_recovers_anywhere_memory_allows():
    """A backup that fails in offload leaves the params resident and intact: recover(TRAINING) is accepted."""
    lc, trainer = _lc()
    trainer.fail_on = "backup:actor"
    with pytest.raises(RuntimeError, match="injected"):
        lc.offload()
    lc.recover(State.TRAINING)
    trainer.fail_on = None
    lc.offload(), lc.pause(), lc.rematerialize(), lc.sync(), lc.resume()
    assert lc.state is State.TRAINING


def test_a_param_sync_failure_recovers_to_rematerialized_to_sync_again():
    """param_sync fails (params half gathered): SYNCED and TRAINING are refused, REMATERIALIZED re-runs the sync."""
    lc, trainer = _lc()
    lc.offload(), lc.pause(), lc.rematerialize()
    trainer.fail_on = "param_sync"
    with pytest.raises(RuntimeError, match="injected"):
        lc.sync()
    for target in (State.SYNCED, State.TRAINING):
        with pytest.raises(RecoveryError, match="would not run sync again"):
            lc.recover(target)
    lc.recover(State.REMATERIALIZED)
    trainer.fail_on = None
    lc.sync(), lc.resume()
    assert lc.state is State.TRAINING
