"""The point of no return of one async call, and the cancellation rules around it.

A ``Gate`` is shared by the worker thread that runs a transition and the
event loop that awaits it. Whoever takes its lock first wins: the
``before_guard`` hook (commit) or the cancelling task (cancel). So a
cancellation either abandons the transition before any collective, or
finds it committed and waits for its end; never in between.
"""

from __future__ import annotations

import enum
import sys
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread

from miles_fsm.errors import TransitionCancelled

__all__ = ["Gate", "Phase", "Ticket", "cuda_device", "deliver", "wait_shielded"]


class Phase(enum.Enum):
    IDLE = "idle"  # the worker thread has not started
    RUNNING = "running"  # planning; still abandonable
    COMMITTED = "committed"  # past the point of no return
    CANCELLED = "cancelled"  # abandoned before the point of no return
    DONE = "done"


class _CancelledBeforeGuard(Exception):
    """Raised by the before_guard hook; the lifecycle turns it into ``TransitionCancelled``."""

    def __init__(self) -> None:
        super().__init__("the task awaiting this transition was cancelled before its guard")


class Gate:
    """One call's point of no return, decided under a lock shared by the thread and the loop."""

    def __init__(self, *, commit_at_start: bool) -> None:
        # Read in the event loop's thread: the worker thread has no async library set.
        self._cancelled_exc = anyio.get_cancelled_exc_class()
        self._lock = threading.Lock()
        self._phase = Phase.IDLE
        self._commit_at_start = commit_at_start
        self.done = threading.Event()
        self.ran = False
        self.value: Any = None
        self.error: BaseException | None = None

    def enter(self) -> bool:
        with self._lock:
            if self._phase is Phase.CANCELLED:
                return False
            self._phase = Phase.COMMITTED if self._commit_at_start else Phase.RUNNING
            self.ran = True
            return True

    def commit(self) -> None:
        """The ``before_guard`` hook, run in the worker thread."""
        with self._lock:
            if self._phase is not Phase.CANCELLED:
                try:
                    # A cancel scope cancelled a moment ago, before the awaiting
                    # task has even been woken: still in time to abandon.
                    anyio.from_thread.check_cancelled()
                except self._cancelled_exc:
                    self._phase = Phase.CANCELLED
            if self._phase is Phase.CANCELLED:
                raise _CancelledBeforeGuard
            self._phase = Phase.COMMITTED

    def finish(self) -> None:
        with self._lock:
            self._phase = Phase.DONE
        self.done.set()

    def cancel(self) -> Phase:
        """Abandon the call if it is not committed; return the phase it was in."""
        with self._lock:
            prior = self._phase
            if prior in (Phase.IDLE, Phase.RUNNING):
                self._phase = Phase.CANCELLED
            return prior

    @property
    def abandoned(self) -> bool:
        """True when the hook refused: the transition ended as ``TransitionCancelled``, by us."""
        return isinstance(self.error, TransitionCancelled) and isinstance(self.error.__cause__, _CancelledBeforeGuard)


@dataclass(slots=True)
class Ticket:
    label: str
    since_mono: float


def deliver(gate: Gate, cancel: BaseException | None) -> None:
    """Raise what the caller must see, in order of importance.

    A committed transition that failed raises its error even when the task was
    cancelled meanwhile: a FAILED rank matters more, and the cancellation
    stays attached as its context. Otherwise the cancellation, if any.
    """
    if gate.error is not None and not gate.abandoned:
        if cancel is not None and hasattr(gate.error, "add_note"):
            gate.error.add_note("miles-fsm: the awaiting task was cancelled while this transition ran")
        raise gate.error
    if cancel is not None:
        raise cancel
    if gate.error is not None:  # abandoned without a cancellation: cannot happen, never hide it
        raise gate.error


async def wait_shielded(done: threading.Event, limiter: anyio.CapacityLimiter) -> None:
    with anyio.CancelScope(shield=True):
        while not done.is_set():
            try:
                await anyio.to_thread.run_sync(done.wait, limiter=limiter)
            except anyio.get_cancelled_exc_class():
                # Only a native asyncio cancel reaches through a shield. The
                # transition is still running: keep waiting; the caller
                # delivers the first cancellation once it is done.
                continue


def cuda_device() -> int | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())
