"""The reference engine: SGLang's memory and weight-update rules, and greedy generation."""

from __future__ import annotations

import pytest
import torch

from miles_fsm.digest import digest_tensors
from miles_fsm.states import EngineDriver
from miles_fsm.drivers.reference.trainer import ReferenceTrainer
from miles_fsm.drivers.reference.model import forward
from miles_fsm.drivers.reference.engine import ReferenceEngine
from miles_fsm.drivers.errors import EngineSessionError
from miles_fsm.errors import MemoryReleasedError
from miles_fsm.states.errors import MemoryTagError


@pytest.fixture
def pair():
    trainer = ReferenceTrainer()
    engine = ReferenceEngine()
    return trainer, engine


def _prompts() -> torch.Tensor:
    return torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0))


def test_engine_implements_the_engine_driver_protocol(pair):
    """ReferenceEngine is an EngineDriver."""
    assert isinstance(pair[1], EngineDriver)


def test_generate_refuses_released_memory_and_garbage_weights(pair):
    """Generating with weights or KV cache released, or with weights resumed but not pushed, raises clearly."""
    trainer, engine = pair
    with pytest.raises(MemoryReleasedError, match="not pushed"):
        engine.generate(_prompts(), max_new_tokens=2)  # never loaded
    engine.update_weights(trainer.named_weights(), version="1")
    engine.release_memory("weights")
    with pytest.raises(MemoryReleasedError, match=r"\[weights\]"):
        engine.generate(_prompts(), max_new_tokens=2)
    engine.resume_memory("weights")
    with pytest.raises(MemoryReleasedError, match="resumed without a backup"):
        engine.generate(_prompts(), max_new_tokens=2)
    engine.update_weights(trainer.named_weights(), version="2")
    engine.release_memory("kv_cache")
    with pytest.raises(MemoryReleasedError, match=r"\[kv_cache\]"):
        engine.generate(_prompts(), max_new_tokens=2)


def test_greedy_generation_with_kv_cache_matches_full_recompute(pair):
    """Incremental decoding through the KV cache picks the same tokens as a full forward of the trainer's weights."""
    trainer, engine = pair
    engine.update_weights(trainer.named_weights(), version="1")
    out = engine.generate(_prompts(), max_new_tokens=6)
    assert out.shape == (2, 10)
    for pos in range(4, 10):
        logits = forward(trainer.weights(), out[:, :pos], trainer.config.model)
        assert torch.equal(logits[:, -1].argmax(-1), out[:, pos])


def test_weight_update_session_rules_and_version(pair):
    """Pushes need an open session, a second begin is refused, and the version is set at end."""
    trainer, engine = pair
    with pytest.raises(EngineSessionError, match="no session"):
        engine.update_weights_from_tensor(trainer.named_weights())
    with pytest.raises(EngineSessionError, match="no session"):
        engine.end_weight_update()
    engine.begin_weight_update()
    with pytest.raises(EngineSessionError, match="already open"):
        engine.begin_weight_update()
    engine.update_weights_from_tensor(trainer.named_weights())
    assert engine.weight_version() is None
    engine.end_weight_update(version="7")
    assert engine.weight_version() == "7"


def test_partial_push_after_a_weights_resume_is_refused(pair):
    """After a weights resume the contents are garbage, so a session that pushes only some weights fails."""
    trainer, engine = pair
    engine.release_memory("weights")
    engine.resume_memory("weights")
    engine.begin_weight_update()
    engine.update_weights_from_tensor(trainer.named_weights()[:3])
    with pytest.raises(EngineSessionError, match="were not pushed"):
        engine.end_weight_update(version="1")


def test_push_rejects_unknown_names_and_wrong_dtypes(pair):
    """A pushed tensor must match a served weight's name, shape and dtype."""
    trainer, engine = pair
    name, tensor = trainer.named_weights()[0]
    with pytest.raises(EngineSessionError, match="unknown weight"):
        engine.update_weights([("nope", tensor)], version="1")
    with pytest.raises(EngineSessionError, match="serves"):
        engine.update_weights([(name, tensor.float())], version="1")


def test_weight_digests_equal_the_pushed_tensors(pair):
    """weight_digests hashes exactly what was pushed."""
    trainer, engine = pair
    engine.update_weights(trainer.named_weights(), version="1")
    assert engine.weight_digests() == digest_tensors(dict(trainer.named_weights()))


def test_double_release_is_refused(pair):
    """Releasing a released tag (which kills SGLang's scheduler) raises instead."""
    _, engine = pair
    engine.release_memory("kv_cache")
    with pytest.raises(MemoryTagError):
        engine.release_memory("kv_cache")
