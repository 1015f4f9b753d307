"""``Machine``: executes a definition on one rank, with ``transitions`` as the executor.

A firing runs through ``transitions``' own callback phases:

- ``prepare``: plan. The owner's planner turns the arrow into steps and, if
  a guard must compare it, an intent; ``transition_started`` is written. An
  error here leaves the state unchanged and nothing in flight.
- ``conditions``: the guard, a validator: every rank agrees on the intent
  before any collective runs, or it raises.
- ``before``: the steps, in table order, each traced.
- the state change, done by ``transitions`` itself.
- ``after``: commit: the epoch moves and ``transition_finished`` is written.
- ``on_exception``: a guard or step error moves the rank to the failed
  state, keeps the cause, tells the peers through the guard's store and
  re-raises; a cancellation before the guard leaves the state unchanged.

The arrow is looked up once, by the definition's table, before anything
runs. The machine knows nothing of tensors or memory: its owner (the
colocated ``Lifecycle`` in ``miles_fsm.states``) supplies the planner, the
epoch rule and the probe that measures memory between steps.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import transitions

from miles_fsm.errors import TransitionCancelled, TransitionNotAllowed, describe
from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    GUARD_ENTERED,
    GUARD_FAILED,
    GUARD_PASSED,
    STORE_UNREACHABLE,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
)

if TYPE_CHECKING:
    from miles_fsm.definition import Definition, Transition
    from miles_fsm.guard.consensus import Guard
    from miles_fsm.plan import Intent
    from miles_fsm.trace.writer import TraceSink

__all__ = ["Failure", "InFlight", "Machine", "Plan", "PlannedStep", "StepResult", "TransitionResult"]

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)

#: Where a firing is: planning, in its ``before_guard`` (a cancellation there fails nothing), at the guard,
#: or in its steps.
_Phase = Literal["plan", "cancel", "guard", "step"]


class Report(Protocol):
    """What an action may return: bytes it moved and host bytes it holds (either may be None)."""

    bytes_moved: int | None
    host_bytes: int | None


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a rank is FAILED: the transition, the state it left, the step (None: the guard) and the error."""

    trigger: enum.Enum
    epoch: int
    step: str | None
    error: BaseException
    source: enum.Enum | None = None


@dataclass(frozen=True, slots=True)
class InFlight:
    """The transition a rank is inside, and where in it."""

    trigger: enum.Enum
    epoch: int
    phase: Literal["plan", "guard", "step"]
    step: str | None
    since_mono: float


@dataclass(frozen=True, slots=True)
class StepResult:
    name: str
    duration_s: float
    bytes_moved: int | None
    host_bytes: int | None


@dataclass(frozen=True, slots=True)
class TransitionResult:
    """What one transition did and how long each part took."""

    trigger: enum.Enum
    epoch: int
    source: enum.Enum
    dest: enum.Enum
    duration_s: float
    guard_s: float
    steps: tuple[StepResult, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved or 0 for s in self.steps)


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One step as the machine runs it: its traced name and its action, bound by the owner."""

    name: str
    step: Any
    action: Callable[[Any, int], Report | None]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one firing will do, decided before anything runs. ``intent`` None: no guard."""

    steps: tuple[PlannedStep, ...]
    intent: Intent | None = None


class _Firing:
    """One trigger's progress through the callbacks; lives only while it runs."""

    __slots__ = ("arrow", "before_guard", "epoch", "guard_s", "phase", "plan", "result", "results", "started", "step")

    def __init__(self, arrow: Any, epoch: int, before_guard: Callable[[], None] | None) -> None:
        self.arrow = arrow
        self.epoch = epoch
        self.before_guard = before_guard
        self.started = time.perf_counter()
        self.phase: _Phase = "plan"
        self.step: str | None = None
        self.guard_s = 0.0
        self.plan: Plan | None = None
        self.results: tuple[StepResult, ...] = ()
        self.result: TransitionResult | None = None


class _Model:
    """The object ``transitions`` decorates; never handed to users."""

    state: str


class Machine(Generic[S, T]):
    """One rank's machine over ``definition``, guarded by ``guard``, traced to ``tracer``.

    ``planner(arrow, epoch)`` returns the ``Plan``; ``next_epoch(trigger,
    epoch)`` is the epoch rule; ``probe()`` measures memory at each step
    boundary (None: unknown); ``timeout_for(trigger)`` is a trigger's guard
    timeout (None: the guard's own); ``on_failure(failure)`` runs once a rank
is failed (the owner dumps its evidence); ``on_commit(result)`` once a transition
    committed (the owner's memory snapshot), its errors the caller's. Every entry point takes ``lock``, which the
    owner shares for work of its own that must not interleave with a
    transition.
    """

    def __init__(
        self,
        *,
        definition: Definition[S, T],
        planner: Callable[[Transition[Any, Any], int], Plan],
        next_epoch: Callable[[Any, int], int],
        guard: Guard,
        tracer: TraceSink,
        probe: Callable[[], int | None] = lambda: None,
        timeout_for: Callable[[str], float | None] = lambda trigger: None,
        on_failure: Callable[[Failure], object] | None = None,
        on_commit: Callable[[TransitionResult], object] | None = None,
    ) -> None:
        self.definition = definition
        self.guard = guard
        self.tracer = tracer
        self.lock = threading.Lock()
        self._planner = planner
        self._next_epoch = next_epoch
        self._probe = probe
        self._timeout_for = timeout_for
        self._on_failure = on_failure
        self._on_commit = on_commit
        self._epoch = 0
        self._failure: Failure | None = None
        self._in_flight: InFlight | None = None
        self._model = _Model()
        self._states: dict[str, S] = {s.value: s for s in definition.states}
        self._machine = transitions.Machine(
            model=self._model,
            states=list(self._states),
            transitions=[
                {
                    "trigger": t.trigger.value,
                    "source": t.source.value,
                    "dest": t.dest.value,
                    "prepare": [self._prepare],
                    "conditions": [self._admit],
                    "before": [self._run_steps],
                    "after": [self._commit],
                }
                for t in definition.transitions
            ],
            initial=definition.initial.value,
            auto_transitions=False,
            send_event=True,
            on_exception=[self._on_exception],
        )
        # The bound trigger of each event, looked up once: a firing calls it directly.
        self._events = {t: self._machine.events[t.value].trigger for t in definition.triggers
                        if t.value in self._machine.events}  # fmt: skip

    # ------------------------------------------------------------------ facts

    @property
    def state(self) -> S:
        return self._states[self._model.state]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def failure(self) -> Failure | None:
        return self._failure

    @property
    def in_flight(self) -> InFlight | None:
        return self._in_flight

    def allowed(self) -> tuple[T, ...]:
        """Triggers that may fire now (none while failed)."""
        return self.definition.allowed(self.state)

    # ----------------------------------------------------------------- firing

    def fire(self, trigger: T, *, before_guard: Callable[[], None] | None = None) -> TransitionResult:
        """Run one transition on this rank (see the module docstring for the phases)."""
        with self.lock:
            source = self.state
            arrow = self.definition.transition(source, trigger)
            if arrow is None:
                failure = self._failure.error if self._failure else None
                raise TransitionNotAllowed(source.value, trigger.value, [t.value for t in self.allowed()], failure)
            firing = _Firing(arrow, self._next_epoch(trigger, self._epoch), before_guard)
            self._events[trigger](self._model, firing)
            assert firing.result is not None  # _commit sets it; every other path raised
            if self._on_commit is not None:  # outside the callbacks: what it raises fails no transition
                self._on_commit(firing.result)
            return firing.result

    def agree(self, intent: Intent, base: Mapping[str, Any]) -> float:
        """Run the guard with its trace records; return its seconds. The caller holds the lock."""
        emit = self.tracer.emit
        emit(GUARD_ENTERED, key=intent.key, collectives=[str(c) for c in intent.collectives],
             tensors=intent.tensors.digest, **base)  # fmt: skip
        t0 = time.perf_counter()
        try:
            self.guard.agree(intent, state=base["state"], timeout_s=self._timeout_for(base["trigger"]))
        except BaseException as exc:
            emit(GUARD_FAILED, **describe(exc), **base)
            raise
        seconds = time.perf_counter() - t0
        emit(GUARD_PASSED, duration_s=seconds, **base)
        return seconds

    def _prepare(self, event: Any) -> None:
        f: _Firing = event.args[0]
        arrow = f.arrow
        self._in_flight = InFlight(arrow.trigger, f.epoch, "plan", None, time.monotonic())
        f.plan = self._planner(arrow, f.epoch)
        self.tracer.emit(TRANSITION_STARTED, state=arrow.source.value, dest=arrow.dest.value,
                         steps=[s.name for s in f.plan.steps], epoch=f.epoch, trigger=arrow.trigger.value)  # fmt: skip
        if f.before_guard is not None:
            f.phase = "cancel"
            f.before_guard()
        f.phase = "guard"

    def _admit(self, event: Any) -> bool:
        f: _Firing = event.args[0]
        assert f.plan is not None  # _prepare made it
        intent = f.plan.intent
        if intent is not None:
            self._in_flight = InFlight(f.arrow.trigger, f.epoch, "guard", None, time.monotonic())
            f.guard_s = self.agree(intent, {"state": f.arrow.source.value, "epoch": f.epoch,
                                            "trigger": f.arrow.trigger.value})  # fmt: skip
        f.phase = "step"
        return True

    def _run_steps(self, event: Any) -> None:
        f: _Firing = event.args[0]
        traced = self.tracer.enabled
        emit = self.tracer.emit
        trigger, epoch = f.arrow.trigger, f.epoch
        base = {"state": f.arrow.source.value, "epoch": epoch, "trigger": trigger.value}
        results = []
        # One probe per step boundary: a step's "after" is the next step's "before".
        mem = self._probe()
        assert f.plan is not None  # _prepare made it
        for planned in f.plan.steps:
            name = f.step = planned.name
            self._in_flight = InFlight(trigger, epoch, "step", name, time.monotonic())
            if traced:
                emit(ACTION_STARTED, action=name, mem_before=mem, **base)
            t0 = time.perf_counter()
            report = planned.action(planned.step, epoch)
            duration = time.perf_counter() - t0
            after = self._probe()
            moved = report.bytes_moved if report is not None else None
            host = report.host_bytes if report is not None else None
            if traced:
                emit(ACTION_FINISHED, action=name, duration_s=duration, bytes_moved=moved, host_bytes=host,
                     mem_before=mem, mem_after=after, **base)  # fmt: skip
            results.append(StepResult(name, duration, moved, host))
            mem = after
        f.step = None
        f.results = tuple(results)

    def _commit(self, event: Any) -> None:
        f: _Firing = event.args[0]
        self._epoch = f.epoch
        self._in_flight = None
        duration = time.perf_counter() - f.started
        arrow = f.arrow
        f.result = TransitionResult(arrow.trigger, f.epoch, arrow.source, arrow.dest, duration, f.guard_s, f.results)
        self.tracer.emit(TRANSITION_FINISHED, state=f.arrow.dest.value, source=f.arrow.source.value,
                         duration_s=duration, epoch=f.epoch, trigger=f.arrow.trigger.value)  # fmt: skip

    def _on_exception(self, event: Any) -> None:
        f: _Firing = event.args[0]
        exc: BaseException = event.error
        self._in_flight = None
        if f.phase == "plan":
            raise exc  # nothing ran: the state is unchanged and nothing is in flight
        base = {"epoch": f.epoch, "trigger": f.arrow.trigger.value}
        if f.phase == "cancel":
            self.tracer.emit(TRANSITION_CANCELLED, state=f.arrow.source.value, **base, **describe(exc))
            raise TransitionCancelled(f.arrow.trigger.value, f.epoch) from exc
        self.fail(f.arrow.trigger, f.epoch, f.step, exc, f.arrow.source, base)
        raise exc

    # ---------------------------------------------------------------- failure

    def fail(self, trigger: Any, epoch: int, step: str | None, exc: BaseException, source: Any,
             base: Mapping[str, Any]) -> None:  # fmt: skip
        """Move to the failed state, keep the cause, trace it and tell the peers."""
        failed = self.definition.failed.value
        self._failure = Failure(trigger, epoch, step, exc, source)
        source = source.value
        self._in_flight = None
        self._machine.set_state(failed, model=self._model)
        self.tracer.emit(TRANSITION_FAILED, state=failed, source=source, action=step,
                         phase="guard" if step is None else "step", **describe(exc), **base)  # fmt: skip
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"miles-fsm: rank {self.guard.rank} is now {failed} "
                         f"({trigger.value}, epoch {epoch}, in {step or 'guard'})")  # fmt: skip
        try:
            self.guard.publish_failure(epoch, trigger.value, source, step=step, error=type(exc).__name__)
        except RuntimeError as store_exc:  # the store's host may be gone; the trace still has it
            self.tracer.emit(STORE_UNREACHABLE, state=failed, **describe(store_exc), **base)
        if self._on_failure is not None:  # after the peers were told: a slow dump must not delay them
            self._on_failure(self._failure)

    def leave_failed(self, target: S) -> Failure | None:
        """Set the state to ``target`` out of the failed state; returns the failure left behind.

        The owner's recovery rules decide whether ``target`` is safe and
        write the ``recovered`` record; the caller holds the lock.
        """
        failure = self._failure
        self._machine.set_state(target.value, model=self._model)
        self._failure = None
        return failure
