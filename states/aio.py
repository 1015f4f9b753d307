"""``AsyncLifecycle``: the async API of the colocated lifecycle, for rollout loops.

The engine's ``AsyncMachine`` does the work (per-rank FIFO lock, worker
threads, the cancellation rule, ``changes()``, ``wait_for``); this adds the
lifecycle's named triggers and ``rollout()``, the window in which the engine
owns the GPU. See ``miles_fsm.aio.machine`` for the cancellation rule.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import anyio
import anyio.lowlevel

from miles_fsm.aio.gate import Gate, deliver
from miles_fsm.aio.machine import AsyncMachine
from miles_fsm.errors import TransitionNotAllowed
from miles_fsm.machine import TransitionResult
from miles_fsm.plan import Collective
from miles_fsm.states.definition import State, Trigger

if TYPE_CHECKING:
    from miles_fsm.states.lifecycle import Lifecycle

__all__ = ["AsyncLifecycle", "RolloutWindow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutWindow:
    """What ``AsyncLifecycle.rollout()`` yields: the cycle and how the engine got the GPU."""

    epoch: int
    entered: tuple[TransitionResult, ...]


class AsyncLifecycle(AsyncMachine[State, Trigger]):
    """The async face of one rank's ``Lifecycle``. Build one per rank, and use it from one event loop.

    Every trigger fired through it is serialized by a per-rank lock (FIFO) and
    published to ``changes()`` iterators and ``wait_for`` waiters. Transitions
    fired on the wrapped ``Lifecycle`` directly are still serialized (it has a
    thread lock of its own) but are not published.
    """

    def __init__(self, lifecycle: Lifecycle) -> None:
        super().__init__(lifecycle)

    @property
    def lifecycle(self) -> Lifecycle:
        """The ``Lifecycle`` this drives."""
        return cast("Lifecycle", super().lifecycle)

    async def start(self) -> TransitionResult:
        return await self.fire(Trigger.START)

    async def offload(self) -> TransitionResult:
        return await self.fire(Trigger.OFFLOAD)

    async def pause(self) -> TransitionResult:
        return await self.fire(Trigger.PAUSE)

    async def rematerialize(self) -> TransitionResult:
        return await self.fire(Trigger.REMATERIALIZE)

    async def sync(self) -> TransitionResult:
        return await self.fire(Trigger.SYNC)

    async def resume(self) -> TransitionResult:
        return await self.fire(Trigger.RESUME)

    async def agree_on(self, step: str, collectives: tuple[Collective, ...]) -> float:
        """``Lifecycle.agree_on`` in a worker thread, in this rank's queue. Once started it is never
        abandoned (it is a collective): a cancellation is delivered when it returns."""
        async with self._turn(f"agree_on({step})"):
            gate = Gate(commit_at_start=True)
            cancel = await self._call(lambda: self.lifecycle.agree_on(step, collectives), gate)
            deliver(gate, cancel)
            seconds: float = gate.value
            return seconds

    @asynccontextmanager
    async def rollout(self) -> AsyncIterator[RolloutWindow]:
        """Give the GPU to the engine for the body, and take it back afterwards.

        Entering: offload, then pause (the push of weights happens there), from
        TRAINING or OFFLOADED. Leaving: rematerialize, sync, resume, back to
        TRAINING, also when the body raises or is cancelled. Leaving is
        shielded: every rank leaves its window, and a rank that abandoned
        its way back would make all the others fail their guard. Its wait is
        still bounded, by the guard timeout.
        """
        if self.lifecycle.state not in (State.TRAINING, State.OFFLOADED):
            await anyio.lowlevel.checkpoint()
            failure = self.lifecycle.failure
            raise TransitionNotAllowed(
                self.lifecycle.state.value,
                "rollout",
                [t.value for t in self.lifecycle.allowed()],
                failure.error if failure else None,
            )
        entered = await self.advance_to(State.PAUSED)
        window = RolloutWindow(epoch=self.lifecycle.epoch, entered=entered)
        try:
            yield window
        except BaseException:
            with anyio.CancelScope(shield=True):
                if self.state is not State.FAILED:
                    await self.advance_to(State.TRAINING)
            raise
        with anyio.CancelScope(shield=True):
            await self.advance_to(State.TRAINING)

