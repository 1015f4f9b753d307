"""What watchers of an async machine receive: state changes, their iterator, and snapshots."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from miles_fsm.machine import Failure, InFlight, TransitionResult

if TYPE_CHECKING:
    from types import TracebackType

    from miles_fsm.aio.machine import AsyncMachine

__all__ = ["AsyncSnapshot", "StateChange", "StateChanges"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StateChange:
    """One move of a rank's state, as published to watchers.

    ``trigger`` is None for ``recover``. ``error`` is set when ``dest`` is
    FAILED; ``result`` when a transition finished and returned. A transition
    that committed and whose caller then got an error from what runs after
    the commit (``MemoryDriftError`` under ``DriftConfig(policy="raise")``)
    is published too, with neither.
    """

    source: Any
    dest: Any
    trigger: Any | None
    epoch: int
    result: TransitionResult | None = None
    error: BaseException | None = None
    at_mono: float

    @property
    def failed(self) -> bool:
        """The rank went to the failed state (only such a change carries an error)."""
        return self.error is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncSnapshot:
    """One rank seen from the async side: the lifecycle's snapshot, plus who waits on its lock.

    ``running`` is what holds the lock now (a trigger, ``advance_to(STATE)``
    or ``recover(STATE)``) and ``running_since_mono`` when it took it;
    ``queued`` are the callers waiting behind it, oldest first.
    """

    lifecycle: Any
    running: str | None
    running_since_mono: float | None
    queued: tuple[str, ...]
    watchers: int

    @property
    def state(self) -> Any:
        return self.lifecycle.state

    # The owner's snapshot is duck-typed (``lifecycle: Any``): these say what its facts are.
    @property
    def epoch(self) -> int:
        epoch: int = self.lifecycle.epoch
        return epoch

    @property
    def in_flight(self) -> InFlight | None:
        in_flight: InFlight | None = self.lifecycle.in_flight
        return in_flight

    @property
    def failure(self) -> Failure | None:
        failure: Failure | None = self.lifecycle.failure
        return failure

    def __getattr__(self, name: str) -> Any:
        # The owner's own facts (the lifecycle's paused tags, say) read through.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.lifecycle, name)

    def __str__(self) -> str:
        s = self.lifecycle
        now = time.monotonic()
        parts = [f"rank {s.rank}/{s.world} {s.state.value} epoch {s.epoch}"]
        if s.in_flight is not None:
            f = s.in_flight
            where = f"step {f.step}" if f.step else f.phase
            parts.append(f"in {f.trigger.value} ({where} for {now - f.since_mono:.3f} s)")
        if self.running is not None and self.running_since_mono is not None:
            parts.append(f"lock held by {self.running} for {now - self.running_since_mono:.3f} s")
        if self.queued:
            parts.append("queued: " + ", ".join(self.queued))
        details = getattr(s, "details", None)
        if details is not None:
            parts.extend(details())
        if s.failure is not None:
            parts.append(f"failed in {s.failure.trigger.value}: {type(s.failure.error).__name__}")
        return "; ".join(parts)


class StateChanges:
    """An async iterator over a rank's state changes, from the moment it was created.

    Use it as ``with alc.changes() as changes: async for change in changes:``
    so that it unsubscribes when the block ends. Each iterator sees every
    change published after its creation, in order; none is dropped.
    """

    def __init__(self, owner: AsyncMachine) -> None:
        self._owner = owner
        self._queue: deque[StateChange] = deque()
        self._wakeup: anyio.Event | None = None
        self._closed = False
        owner._subscribers.add(self)

    def _push(self, change: StateChange) -> None:
        self._queue.append(change)
        if self._wakeup is not None:
            self._wakeup.set()

    def close(self) -> None:
        """Stop receiving changes; a pending ``__anext__`` ends the iteration."""
        self._closed = True
        self._owner._subscribers.discard(self)
        if self._wakeup is not None:
            self._wakeup.set()

    def __enter__(self) -> StateChanges:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __aiter__(self) -> StateChanges:
        return self

    async def __anext__(self) -> StateChange:
        await anyio.lowlevel.checkpoint()
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            wakeup = self._wakeup = anyio.Event()
            await wakeup.wait()
        return self._queue.popleft()
