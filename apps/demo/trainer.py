"""``DemoTrainer``: the reference trainer with the demo's faults (``miles_fsm.apps.demo.faults`` says which).

Imported through ``demo_trainer_cls()``, on first use: it imports torch.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from miles_fsm.apps.demo.faults import DIVERGE_PARAM, LEAK_BYTES, hang_forever
from miles_fsm.drivers.reference.trainer import ReferenceTrainer
from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import StepKind, Strategy

__all__ = ["DemoTrainer"]


class DemoTrainer(ReferenceTrainer):
    """The reference trainer with the demo's faults, armed for one step at a time."""

    armed: str | None = None
    stray: Any = None  # the undeclared collective's work, waited for in the next train step
    side_group: Any = None  # made on every rank when an ``undeclared`` fault is injected
    leaked: list[Any] | None = None  # a ``leak`` rank's kept buffers, from its armed step on: no driver counts them

    @property
    def _believed_frozen(self) -> int:
        """Elements this rank wrongly leaves out of its buffer while ``diverge`` is armed."""
        return self.params[DIVERGE_PARAM].numel() if self.armed == "diverge" else 0

    @property
    def structure_version(self) -> tuple[object, str | None]:
        # ``diverge`` changes the tensor set: the planning cache must see it move.
        return (super().structure_version, self.armed)

    def tensor_set(self) -> TensorSet:
        tensors = super().tensor_set()
        if self.armed != "diverge":
            return tensors
        return TensorSet(tuple(s for s in tensors.specs if s.name != DIVERGE_PARAM))

    def collectives(self, step: Any) -> tuple[Collective, ...]:
        out = super().collectives(step)
        if step.kind is StepKind.PARAM_SYNC:
            out = tuple(Collective(c.op, c.group, c.dtype, c.numel - self._believed_frozen) for c in out)
        return out

    def train_collectives(self) -> tuple[Collective, ...]:
        return tuple(
            Collective(c.op, c.group, c.dtype, c.numel - (self._believed_frozen if c.op != "all_reduce" else 0))
            for c in super().train_collectives()
        )

    def cast_main_to_params(self) -> Any:
        if self.armed == "corrupt":
            self.flip_master_bit()
        return super().cast_main_to_params()

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed == "stall":
            hang_forever()
        if self.armed == "leak" or self.leaked is not None:
            import torch

            kept = torch.empty(LEAK_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            kept.fill_(1)  # written: its pages are resident, as a real buffer's are
            self.leaked = [*(self.leaked or ()), kept]
        if self.stray is not None:  # an overlapped collective, waited for where its result is used
            self.stray.wait()
        return super().train_step(*args, **kwargs)

    def param_sync(self) -> Any:
        # After the guard passed: the peers are inside the all-gather with us when we die.
        if self.armed == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        report = super().param_sync()
        self.issue_undeclared()
        return report

    def issue_undeclared(self) -> None:
        """The bug the audit exists for: one collective more than the plan said, left in flight."""
        if self.armed != "undeclared":
            return
        import torch
        import torch.distributed as dist

        # Started and left in flight: the step returns, as an overlapped collective would.
        self.stray = dist.all_reduce(torch.ones(1), group=self.side_group, async_op=True)

    def restore(self, tag: str) -> Any:
        if self.armed == "crash" and self.strategy is Strategy.BACKUP:  # no param sync under backup
            os.kill(os.getpid(), signal.SIGKILL)
        if self.armed == "corrupt" and self.strategy is Strategy.BACKUP:
            self.flip_master_bit()
        report = super().restore(tag)
        if self.strategy is Strategy.BACKUP:
            self.issue_undeclared()
        return report

    def flip_master_bit(self) -> None:
        """Flip the sign bit of one master weight inside a param this rank alone owns."""
        import torch

        name = self.param_within_shard(self.rank)
        start = self.offset_of(name)[0] if name is not None else self.rank * self.shard_numel
        i = start - self.rank * self.shard_numel
        self.main_shard.view(torch.int32)[i : i + 1].bitwise_xor_(torch.tensor([-(2**31)], dtype=torch.int32))
