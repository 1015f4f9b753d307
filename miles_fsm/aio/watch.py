"""What watchers of an async machine receive: state changes, their iterator, and snapshots."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel

from miles_fsm.definition import S, T
from miles_fsm.machine import Failure, InFlight, TransitionResult

if TYPE_CHECKING:
    from types import TracebackType

    from miles_fsm.aio.machine import AsyncMachine

__all__ = ["AsyncSnapshot", "MachineSnapshot", "StateChange", "StateChanges"]

S_co = TypeVar("S_co", bound=enum.Enum, covariant=True)


class MachineSnapshot(Protocol[S_co]):
    """What an ``AsyncSnapshot`` wraps: the owner's own snapshot (the lifecycle's is a
    ``miles_fsm.states.Snapshot``)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def state(self) -> S_co: ...

    @property
    def epoch(self) -> int: ...

    @property
    def in_flight(self) -> InFlight | None: ...

    @property
    def failure(self) -> Failure | None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StateChange(Generic[S, T]):
    """One move of a rank's state, as published to watchers.

    ``trigger`` is None for ``recover``. ``error`` is set when ``dest`` is
    FAILED; ``result`` when a transition finished and returned. A transition
    that committed and whose caller then got an error from what runs after
    the commit (``MemoryDriftError`` under ``DriftConfig(policy="raise")``)
    is published too, with neither.
    """

    source: S
    dest: S
    trigger: T | None
    epoch: int
    result: TransitionResult | None = None
    error: BaseException | None = None
    at_mono: float

    @property
    def failed(self) -> bool:
        """The rank went to the failed state (only such a change carries an error)."""
        return self.error is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncSnapshot(Generic[S]):
    """One rank seen from the async side: the lifecycle's snapshot, plus who waits on its lock.

    ``running`` is what holds the lock now (a trigger, ``advance_to(STATE)``
    or ``recover(STATE)``) and ``running_since_mono`` when it took it;
    ``queued`` are the callers waiting behind it, oldest first.
    """

    lifecycle: MachineSnapshot[S]
    running: str | None
    running_since_mono: float | None
    queued: tuple[str, ...]
    watchers: int

    @property
    def state(self) -> S:
        return self.lifecycle.state

    @property
    def epoch(self) -> int:
        return self.lifecycle.epoch

    @property
    def in_flight(self) -> InFlight | None:
        return self.lifecycle.in_flight

    @property
    def failure(self) -> Failure | None:
        return self.lifecycle.failure

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


class StateChanges(Generic[S, T]):
    """An async iterator over a rank's state changes, from the moment it was created.

    Use it as ``with alc.changes() as changes: async for change in changes:``
    so that it unsubscribes when the block ends. Each iterator sees every
    change published after its creation, in order; none is dropped.
    """

    def __init__(self, owner: AsyncMachine[S, T]) -> None:
        self._owner = owner
        self._queue: deque[StateChange[S, T]] = deque()
        self._wakeup: anyio.Event | None = None
        self._closed = False
        owner._subscribers.add(self)

    def _push(self, change: StateChange[S, T]) -> None:
        self._queue.append(change)
        if self._wakeup is not None:
            self._wakeup.set()

    def close(self) -> None:
        """Stop receiving changes; a pending ``__anext__`` ends the iteration."""
        self._closed = True
        self._owner._subscribers.discard(self)
        if self._wakeup is not None:
            self._wakeup.set()

    def __enter__(self) -> StateChanges[S, T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __aiter__(self) -> StateChanges[S, T]:
        return self

    async def __anext__(self) -> StateChange[S, T]:
        await anyio.lowlevel.checkpoint()
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            wakeup = self._wakeup = anyio.Event()
            await wakeup.wait()
        return self._queue.popleft()
