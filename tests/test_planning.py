"""Planning at many tensors: the tensor set cached per ``structure_version``, and the checks that keep it honest."""

from __future__ import annotations

import pytest

from miles_fsm import GuardConfig, Lifecycle, LifecycleConfig, State, VerifyConfig
from miles_fsm.states.errors import StructureVersionError
from miles_fsm.guard.consensus import Guard
from miles_fsm.states.planning import trusted_version
from toy import ToyEngine, ToyTrainer

CYCLE = ("offload", "pause", "rematerialize", "sync", "resume")


class Counting(ToyTrainer):
    """A toy trainer with a structure version; counts its tensor-set walks."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.walks = 0

    @property
    def structure_version(self) -> int:
        return self.version

    def tensor_set(self):
        self.walks += 1
        return super().tensor_set()


class Recording(Guard):
    """A guard that says it has peers, and records the intents it is asked to agree on."""

    def agree(self, intent, *, state, timeout_s=None):
        self.intents.append(intent)


class _NullStore:
    def set(self, key, value):
        pass


def make(trainer, *, verified_cycles=1):
    guard = Recording(rank=0, world=2, group=None, store=_NullStore(), timeout_s=5.0)
    guard.intents = []
    verify = VerifyConfig(cycles=verified_cycles, ci_verifies_every_cycle=False)
    lc = Lifecycle(trainer=trainer, engine=ToyEngine(), guard=guard,
                   config=LifecycleConfig(guard=GuardConfig(), verify=verify, run_id="r"))  # fmt: skip
    return lc, guard


def cycles(lc, n):
    for _ in range(n):
        for t in CYCLE:
            lc.fire(t)


def test_an_unchanged_structure_version_plans_unverified_cycles_without_walking_the_tensor_set():
    """Past the verified cycles, a trainer whose version stays put is not walked again, and every
    intent still carries its tensor set."""
    trainer = Counting()
    lc, guard = make(trainer, verified_cycles=1)
    lc.start()
    cycles(lc, 1)  # epoch 1: verified, so walked each transition
    walked = trainer.walks
    cycles(lc, 3)
    assert trainer.walks == walked
    assert {i.tensors.digest for i in guard.intents} == {trainer.tensor_set().digest}


def test_a_changed_structure_version_is_walked_again_and_the_guard_sees_the_new_set():
    """A version bump on an unverified cycle makes the next intent carry the new tensor set."""
    import torch

    trainer = Counting()
    lc, guard = make(trainer, verified_cycles=0)
    lc.start()
    lc.offload()
    trainer.params["adapter"] = torch.zeros(3, dtype=torch.bfloat16)
    trainer.version += 1
    lc.pause()
    assert "adapter" in guard.intents[-1].tensors.names
    assert "adapter" not in guard.intents[-2].tensors.names


def test_a_version_that_does_not_move_with_the_set_is_caught_on_a_verified_cycle():
    """A tensor set changed behind an unchanged version raises StructureVersionError naming the change
    before the guard, on the next verified transition; the state stays where it was."""
    import torch

    trainer = Counting()
    lc, guard = make(trainer, verified_cycles=None)
    lc.start()
    lc.offload()
    seen = len(guard.intents)
    trainer.params["adapter"] = torch.zeros(3, dtype=torch.bfloat16)  # no version bump: the driver lies
    with pytest.raises(StructureVersionError) as info:
        lc.pause()
    assert info.value.added == ("adapter[3]:bfloat16",) and info.value.removed == ()
    assert lc.state is State.OFFLOADED and len(guard.intents) == seen
    lc.pause()  # the lying version is not trusted again: walked, and the guard sees the truth
    assert "adapter" in guard.intents[-1].tensors.names


def test_a_subclass_that_overrides_tensor_set_but_inherits_the_version_is_walked_every_time():
    """The seed's bug, guarded: a per-rank tensor_set override that its inherited version cannot see
    is never served from the cache."""

    class Diverging(Counting):
        hide = False

        def tensor_set(self):
            full = super().tensor_set()
            return type(full)(tuple(s for s in full.specs if not (self.hide and s.name == "b")))

    trainer = Diverging()
    assert not trusted_version(trainer) and trusted_version(Counting()) and not trusted_version(ToyTrainer())
    lc, guard = make(trainer, verified_cycles=0)
    lc.start()
    lc.offload()
    trainer.hide = True
    lc.pause()
    assert "b" in guard.intents[-2].tensors.names and "b" not in guard.intents[-1].tensors.names


def test_the_demo_diverge_fault_moves_the_structure_version():
    """The demo's `diverge` changes the tensor set, so its trainer's version must change with it."""
    from miles_fsm.apps.demo.faults import demo_trainer_cls

    trainer = demo_trainer_cls()()
    before = trainer.structure_version
    trainer.armed = "diverge"
    assert trusted_version(trainer) and trainer.structure_version != before


def test_torch_module_registrations_move_the_megatron_structure_version():
    """Adding or replacing a param, buffer or submodule anywhere in the process changes the count the
    megatron driver reports as its structure version."""
    import torch

    from miles_fsm.drivers.structure import registrations

    module = torch.nn.Linear(2, 2)
    seen = [registrations()]
    module.weight = torch.nn.Parameter(torch.zeros(3, 2))
    seen.append(registrations())
    module.register_buffer("scale", torch.ones(1))
    seen.append(registrations())
    module.extra = torch.nn.Identity()
    seen.append(registrations())
    assert len(set(seen)) == 4
