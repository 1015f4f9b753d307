"""Async API for rollout loops: drive and await one rank's lifecycle from anyio.

Works on asyncio and trio. Each transition runs the blocking
``Lifecycle.fire`` in a worker thread, so the event loop keeps serving
generation requests while weights move.

Cancellation follows one rule: a transition may be abandoned only before its
point of no return, the ``before_guard`` hook that ``Lifecycle.fire`` calls
after planning and before the guard (or, without a guard, before the first
step).

- Cancelled before it: the hook raises, the lifecycle records
  ``transition_cancelled`` and leaves the state unchanged. This rank enters no
  collective; the other ranks get their guard's timeout or divergence error.
- Cancelled after it: the transition runs to its end (the task waits for it,
  shielded), and only then is the cancellation delivered. Leaving a collective
  halfway is exactly how the other ranks hang.

Timeouts (``anyio.fail_after``/``move_on_after``, ``asyncio.timeout``) are
cancellations and follow the same rule. Unlike ``transitions``' AsyncMachine,
a new trigger never cancels the running transition: it queues behind it on
this rank's lock.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Generic, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from miles_fsm.aio.gate import Gate, Phase, Ticket, cuda_device, deliver, wait_shielded
from miles_fsm.aio.watch import AsyncSnapshot, MachineSnapshot, StateChange, StateChanges
from miles_fsm.definition import Definition, S, T
from miles_fsm.errors import RankFailedError, TransitionNotAllowed, describe
from miles_fsm.machine import Failure, TransitionResult
from miles_fsm.trace.schema import CANCEL_DEFERRED

if TYPE_CHECKING:
    from miles_fsm.trace.writer import TraceSink

__all__ = ["AsyncMachine", "AsyncSnapshot", "Drivable", "MachineSnapshot", "StateChange", "StateChanges"]

#: Worker threads this API may hold at once per rank: the transition, plus
#: short-lived waiters for a transition whose awaiting task was cancelled.
#: Private so that a busy default thread pool never delays a rank's guard.
_THREADS = 4


class Drivable(Protocol[S, T]):
    """What an ``AsyncMachine`` drives: one rank's machine over states ``S`` and triggers ``T``.

    The colocated ``Lifecycle`` is one (``Drivable[State, Trigger]``).
    """

    @property
    def definition(self) -> Definition[S, T]: ...

    @property
    def state(self) -> S: ...

    @property
    def epoch(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def failure(self) -> Failure | None: ...

    @property
    def tracer(self) -> TraceSink: ...

    def allowed(self) -> tuple[T, ...]: ...

    def snapshot(self) -> MachineSnapshot[S]: ...

    def fire(self, trigger: T, *, before_guard: Callable[[], None] | None = None) -> TransitionResult: ...

    def recover(self, to: S) -> None: ...


class AsyncMachine(Generic[S, T]):
    """The async face of one rank's machine. Build one per rank, and use it from one event loop.

    It drives any ``Drivable``: the colocated ``Lifecycle`` is one
    (``miles_fsm.states.AsyncLifecycle`` adds its named triggers and the
    rollout window). A trigger or state may be given as its enum member or
    its value (``"offload"``).

    Every trigger fired through it is serialized by a per-rank lock (FIFO) and
    published to ``changes()`` iterators and ``wait_for`` waiters. Transitions
    fired on the wrapped ``Lifecycle`` directly are still serialized (it has a
    thread lock of its own) but are not published.
    """

    def __init__(self, lifecycle: Drivable[S, T]) -> None:
        self._lc = lifecycle
        self._definition = lifecycle.definition
        self._subscribers: weakref.WeakSet[StateChanges[S, T]] = weakref.WeakSet()
        self._queued: list[Ticket] = []
        self._running: Ticket | None = None
        # Created on first use, inside the event loop they belong to.
        self._lock: anyio.Lock | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ facts

    @property
    def lifecycle(self) -> Drivable[S, T]:
        """The machine this drives."""
        return self._lc

    @property
    def state(self) -> S:
        return self._lc.state

    @property
    def epoch(self) -> int:
        return self._lc.epoch

    @property
    def rank(self) -> int:
        return self._lc.rank

    def snapshot(self) -> AsyncSnapshot[S]:
        """State, epoch, the transition in flight and since when, paused tags, and the lock's queue."""
        running = self._running
        return AsyncSnapshot(
            lifecycle=self._lc.snapshot(),
            running=running.label if running else None,
            running_since_mono=running.since_mono if running else None,
            queued=tuple(t.label for t in self._queued),
            watchers=len(self._subscribers),
        )

    # --------------------------------------------------------------- triggers

    async def fire(self, trigger: T | str) -> TransitionResult:
        """Run one transition in a worker thread, after any queued before it."""
        member = self._definition.triggers(trigger)
        async with self._turn(member.value):
            return await self._fire_locked(member)

    async def advance_to(self, state: S | str) -> tuple[TransitionResult, ...]:
        """Fire the triggers along the table until the rank is in ``state``; hold the lock throughout.

        Each transition follows the cancellation rule on its own: a
        cancellation stops the walk after the transition it arrived in.
        """
        target = self._definition.states(state)
        async with self._turn(f"advance_to({target.value})"):
            results: list[TransitionResult] = []
            while self._lc.state is not target:
                path = self._definition.path(self._lc.state, target)
                if not path:
                    failure = self._lc.failure
                    raise TransitionNotAllowed(
                        self._lc.state.value,
                        f"advance_to({target.value})",
                        [t.value for t in self._lc.allowed()],
                        failure.error if failure else None,
                    )
                results.append(await self._fire_locked(path[0]))
            return tuple(results)

    async def recover(self, to: S | str) -> None:
        """The owner's ``recover`` in a worker thread. Once started it is never abandoned."""
        target = self._definition.states(to)
        async with self._turn(f"recover({target.value})"):
            source = self._lc.state
            gate = Gate(commit_at_start=True)
            cancel = await self._call(lambda: self._lc.recover(target), gate)
            if gate.ran and gate.error is None:
                self._publish(
                    StateChange(
                        source=source, dest=target, trigger=None, epoch=self._lc.epoch, at_mono=time.monotonic()
                    )
                )
            deliver(gate, cancel)

    # ------------------------------------------------------------------ waits

    def changes(self) -> StateChanges[S, T]:
        """An async iterator of the changes published from now on (see ``StateChanges``)."""
        return StateChanges(self)

    async def wait_for(self, state: S | str) -> None:
        """Return once the rank is in ``state``, or has reached it since this call began.

        Raises ``RankFailedError`` if the rank is or goes FAILED first (unless
        ``state`` is FAILED): a waiter is never left hanging on a dead rank.
        Another task may move the rank on before the waiter runs again.
        """
        target = self._definition.states(state)
        with self.changes() as changes:
            current = self._lc.state
            if current is target:
                await anyio.lowlevel.checkpoint()
                return
            if current is self._definition.failed:
                await anyio.lowlevel.checkpoint()
                raise self._failed_error(target)
            async for change in changes:
                if change.dest is target:
                    return
                if change.failed:
                    raise self._failed_error(target)

    # -------------------------------------------------------------- internals

    def _primitives(self) -> tuple[anyio.Lock, anyio.CapacityLimiter]:
        if self._lock is None or self._limiter is None:
            self._lock = anyio.Lock()
            self._limiter = anyio.CapacityLimiter(_THREADS)
        return self._lock, self._limiter

    @asynccontextmanager
    async def _turn(self, label: str) -> AsyncIterator[None]:
        lock, _ = self._primitives()
        ticket = Ticket(label, time.monotonic())
        self._queued.append(ticket)
        try:
            await lock.acquire()  # cancellable: nothing has started
        finally:
            self._queued.remove(ticket)
        ticket.since_mono = time.monotonic()
        self._running = ticket
        try:
            yield
        finally:
            self._running = None
            lock.release()

    async def _fire_locked(self, trigger: T) -> TransitionResult:
        lc = self._lc
        source = lc.state
        gate = Gate(commit_at_start=False)
        cancel = await self._call(lambda: lc.fire(trigger, before_guard=gate.commit), gate)
        if gate.ran and not gate.abandoned:
            if gate.error is None:
                result: TransitionResult = gate.value
                self._publish(
                    StateChange(
                        source=source,
                        dest=self._definition.states(result.dest),
                        trigger=trigger,
                        epoch=result.epoch,
                        result=result,
                        at_mono=time.monotonic(),
                    )
                )
            elif lc.state is self._definition.failed and source is not self._definition.failed:
                failure = lc.failure
                self._publish(
                    StateChange(
                        source=source,
                        dest=self._definition.failed,
                        trigger=trigger,
                        epoch=failure.epoch if failure else lc.epoch,
                        error=gate.error,
                        at_mono=time.monotonic(),
                    )
                )
            elif lc.state is not source:
                # Committed, then the owner's on_commit raised (MemoryDriftError under policy="raise"): the
                # rank did move, so watchers see it; the caller gets the error, and no result came back.
                self._publish(
                    StateChange(source=source, dest=lc.state, trigger=trigger, epoch=lc.epoch, at_mono=time.monotonic())
                )
        deliver(gate, cancel)
        value: TransitionResult = gate.value
        return value

    async def _call(self, fn: Callable[[], Any], gate: Gate) -> BaseException | None:
        """Run ``fn`` in a worker thread under ``gate``; return the cancellation to deliver, if any.

        The thread is started abandonable, so that any cancellation (an anyio
        scope, trio, or a native ``task.cancel()``/``asyncio.timeout``, which
        anyio's non-abandoning mode does not hold back) reaches this task at
        once. The gate then decides: before the point of no return the
        transition is abandoned; after it, this task waits for the thread,
        shielded, and the caller delivers the cancellation afterwards.
        """
        _, limiter = self._primitives()
        device = cuda_device()

        def work() -> None:
            if not gate.enter():
                return
            try:
                if device is not None:
                    # The CUDA device is per thread; collectives must run on the rank's own.
                    sys.modules["torch"].cuda.set_device(device)
                gate.value = fn()
            except BaseException as exc:
                gate.error = exc
            finally:
                gate.finish()

        try:
            await anyio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=limiter)
            if gate.abandoned:
                # The hook saw the cancellation before this task was told of it.
                await anyio.lowlevel.checkpoint_if_cancelled()
        except anyio.get_cancelled_exc_class() as cancel:
            prior = gate.cancel()
            if prior is Phase.COMMITTED:
                in_flight = self._lc.snapshot().in_flight
                self._lc.tracer.emit(
                    CANCEL_DEFERRED,
                    epoch=in_flight.epoch if in_flight else self._lc.epoch,
                    trigger=in_flight.trigger.value if in_flight else None,
                    state=self._lc.state.value,
                    phase=in_flight.phase if in_flight else None,
                    action=in_flight.step if in_flight else None,
                )
            if prior is not Phase.IDLE:
                await wait_shielded(gate.done, limiter)
            return cancel
        return None

    def _publish(self, change: StateChange[S, T]) -> None:
        for sub in list(self._subscribers):
            sub._push(change)

    def _failed_error(self, target: S) -> RankFailedError:
        failure = self._lc.failure
        if failure is None:  # FAILED without a recorded failure cannot happen; say so rather than guess
            return RankFailedError(
                rank=self.rank,
                waiting_for=target.value,
                trigger="?",
                epoch=self.epoch,
                step=None,
                cause="no failure recorded",
            )
        d = describe(failure.error)
        return RankFailedError(
            rank=self.rank,
            waiting_for=target.value,
            trigger=failure.trigger.value,
            epoch=failure.epoch,
            step=failure.step,
            cause=f"{d.get('error')}: {d.get('message')}",
        )
