"""``MegatronDriverConfig``: the rematerialize constraints as a typed, validated config.

Pure Python: these run without megatron-core.
"""

from __future__ import annotations

import logging

import pytest

from miles_fsm.drivers.megatron.config import MegatronDriverConfig
from miles_fsm.errors import ConfigError
from miles_fsm.states import Strategy


def test_every_violation_is_reported_at_once():
    """Breaking all thirteen rematerialize constraints yields one ConfigError listing all thirteen."""
    with pytest.raises(ConfigError) as info:
        MegatronDriverConfig(
            backend="fsdp",
            lora=True,
            optimizer_enabled=False,
            independent_dp_cells=2,
            colocate=False,
            offload_train=False,
            offload_target="disk",
            use_distributed_optimizer=False,
            keep_old_actor=True,
            precision_aware_optimizer=True,
            optimizer_cpu_offload=False,
            overlap_param_gather=True,
            compute_advantages=False,
            critic_only_steps=3,
        )
    violations = info.value.violations
    assert len(violations) == 13
    for word in ("backend", "LoRA", "optimizer must be enabled", "independent DP", "colocate", "offload_train",
                 "'disk'", "distributed optimizer", "keep_old_actor", "precision-aware", "overlap_param_gather",
                 "advantages", "critic-only"):
        assert any(word in v for v in violations), word
    assert "13 constraint(s)" in str(info.value)


def test_two_violations_are_both_named():
    """A config with exactly two problems names exactly those two."""
    with pytest.raises(ConfigError) as info:
        MegatronDriverConfig(keep_old_actor=True, overlap_param_gather=True)
    assert len(info.value.violations) == 2


def test_precision_aware_optimizer_is_allowed_with_cpu_offload():
    """The precision-aware optimizer is fine when the optimizer is offloaded to CPU."""
    cfg = MegatronDriverConfig(precision_aware_optimizer=True, optimizer_cpu_offload=True)
    assert cfg.effective_strategy is Strategy.REMATERIALIZE


def test_backup_strategy_ignores_rematerialize_constraints():
    """The constraints only guard rematerialize; backup accepts a run that breaks them."""
    cfg = MegatronDriverConfig(strategy="backup", keep_old_actor=True, colocate=False)
    assert cfg.effective_strategy is Strategy.BACKUP


def test_train_only_debug_turns_rematerialize_off_and_logs_why(caplog):
    """Train-only debug runs the backup strategy, skips the constraints, and says so in the log."""
    with caplog.at_level(logging.WARNING, logger="miles_fsm.drivers.megatron.driver"):
        cfg = MegatronDriverConfig(train_only_debug=True, colocate=False)
    assert cfg.strategy is Strategy.REMATERIALIZE
    assert cfg.effective_strategy is Strategy.BACKUP
    assert any("rematerialize is off" in r.getMessage() for r in caplog.records)


def test_ci_mode_verifies_every_cycle(monkeypatch):
    """Under CI=true SHA256 verification covers every cycle; otherwise the first verify_cycles."""
    monkeypatch.setenv("CI", "true")
    assert MegatronDriverConfig().verify.cycles is None
    monkeypatch.setenv("CI", "")
    plain = MegatronDriverConfig(verify_cycles=2)
    assert plain.ci is False
    assert plain.verify.active(2) and not plain.verify.active(3)


def test_bad_field_values_are_refused_together_with_constraints():
    """Out-of-range fields are reported in the same error as the constraint violations."""
    with pytest.raises(ConfigError) as info:
        MegatronDriverConfig(verify_cycles=-1, critic_only_steps=-1, keep_old_actor=True)
    assert len(info.value.violations) == 3


def test_tags_pause_in_the_seed_order():
    """Grads and optimizer state first, params last; only 'default' keeps a region backup."""
    tags = MegatronDriverConfig().tag_memory
    assert [t.tag for t in tags] == ["grad_buffer", "default", "param_buffer"]
    assert {t.tag: t.cpu_backup for t in tags} == {"grad_buffer": False, "default": True, "param_buffer": False}
