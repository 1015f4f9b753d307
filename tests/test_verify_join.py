"""The record pass of verification runs beside the offload and is joined before anything could change what it reads.

On a GPU ``record_digests`` only queues the digests (``start_digests``), so the
offload's copies overlap the kernel. A pause that may release the verified
tensors, or a step that writes them, must wait for it first, or the kernel
reads freed or rewritten memory. These tests stand in a pending digest that
logs when it is waited for, so the order is visible on a CPU host.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miles_fsm.config import VerifyConfig
from miles_fsm.digest import digest_tensors
from miles_fsm.states import actions as actions_module
from miles_fsm.states.actions import Actions
from miles_fsm.states.definition import Side, Step, StepKind
from miles_fsm.trace.writer import NullTracer


class _Pending:
    def __init__(self, log: list[str], tensors: dict[str, torch.Tensor]) -> None:
        self._log, self._tensors, self._out = log, tensors, None

    @property
    def ready(self) -> bool:
        return self._out is not None

    def wait(self) -> dict[str, str]:
        if self._out is None:
            self._log.append("joined")
            self._out = digest_tensors(self._tensors)
        return self._out

    def chunks(self) -> dict[str, str]:
        return self.wait()


class _Trainer:
    def __init__(self, log: list[str], verified_tags: frozenset[str] | None) -> None:
        self.log = log
        self.params = {"w": torch.arange(6.0)}
        if verified_tags is not None:
            self.verified_tags = verified_tags

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.params

    def pause_memory(self, tag: str) -> None:
        self.log.append(f"pause {tag}")

    def resume_memory(self, tag: str) -> None:
        self.log.append(f"resume {tag}")

    def cast_main_to_params(self) -> None:
        self.log.append("cast")


def _actions(monkeypatch: pytest.MonkeyPatch, verified_tags: frozenset[str] | None) -> tuple[Actions, list[str]]:
    log: list[str] = []
    monkeypatch.setattr(actions_module, "start_digests", lambda tensors, **kw: _Pending(log, dict(tensors)))
    trainer = _Trainer(log, verified_tags)
    acts = Actions(trainer=trainer, engine=None, verify=VerifyConfig(cycles=None), tracer=NullTracer())  # type: ignore[arg-type]
    return acts, log


def _run(acts: Actions, kind: StepKind, *tags: str) -> None:
    acts.table[kind](Step(kind, Side.TRAINER, tags=tags), 1)


def test_pausing_other_tags_overlaps_the_record_pass_and_the_params_tag_waits_for_it(monkeypatch):
    acts, log = _actions(monkeypatch, frozenset({"param_buffer"}))
    _run(acts, StepKind.RECORD_DIGESTS)
    _run(acts, StepKind.PAUSE_MEMORY, "grad_buffer", "default")
    assert log == ["pause grad_buffer", "pause default"], "a pause of a tag free of params waited for the digests"
    _run(acts, StepKind.PAUSE_MEMORY, "param_buffer")
    assert log[2:] == ["joined", "pause param_buffer"]


def test_a_trainer_that_does_not_name_its_tags_waits_before_any_pause(monkeypatch):
    acts, log = _actions(monkeypatch, None)
    _run(acts, StepKind.RECORD_DIGESTS)
    _run(acts, StepKind.PAUSE_MEMORY, "default")
    assert log == ["joined", "pause default"]


def test_a_step_that_writes_params_waits_for_the_record_pass(monkeypatch):
    acts, log = _actions(monkeypatch, frozenset({"param_buffer"}))
    _run(acts, StepKind.RECORD_DIGESTS)
    _run(acts, StepKind.CAST_MAIN_TO_PARAMS)
    assert log == ["joined", "cast"]


def test_verify_compares_against_the_digests_recorded_before_the_change(monkeypatch):
    acts, log = _actions(monkeypatch, frozenset({"param_buffer"}))
    _run(acts, StepKind.RECORD_DIGESTS)
    trainer: Any = acts._trainer
    _run(acts, StepKind.CAST_MAIN_TO_PARAMS)  # joins: the record holds the bytes before the write below
    trainer.params["w"][0] = 99.0
    with pytest.raises(actions_module.VerificationError) as info:
        _run(acts, StepKind.VERIFY)
    assert tuple(info.value.mismatched) == ("w",)
