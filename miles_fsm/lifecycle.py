"""``Lifecycle``: one rank's guarded, traced memory state machine.

The table lives in ``miles_fsm.states``; this module executes it. A trigger
runs in four phases, each traced:

1. check the trigger is allowed (else ``TransitionNotAllowed``, nothing runs);
2. plan: the collectives and tensor set, from rank-uniform facts only;
3. guard: every rank agrees on the plan before any collective runs;
4. steps, in table order; the state moves only when all of them succeeded.

A step that raises moves the rank to FAILED with the cause kept; FAILED
refuses every trigger until ``recover(to=...)`` says what memory is in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import transitions

from miles_fsm.config import LifecycleConfig
from miles_fsm.digest import digest_tensors
from miles_fsm.errors import (
    RecoveryError,
    TensorSetChangedError,
    TransitionCancelled,
    TransitionNotAllowed,
    VerificationError,
    WeightVersionError,
    describe,
)
from miles_fsm.guard import Guard
from miles_fsm.memory import MemoryLedger
from miles_fsm.plan import TensorSet
from miles_fsm.states import DEFINITION, Side, State, Step, StepKind, Trigger
from miles_fsm.tracing import NullTracer, Tracer, TraceSink

if TYPE_CHECKING:
    from miles_fsm.drivers.protocols import EngineDriver, StepReport, TrainerDriver
    from miles_fsm.plan import Collective, Intent

__all__ = ["Failure", "InFlight", "Lifecycle", "Snapshot", "StepResult", "TransitionResult"]


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a rank is FAILED: the transition, the step (None: the guard) and the error."""

    trigger: Trigger
    epoch: int
    step: str | None
    error: BaseException


@dataclass(frozen=True, slots=True)
class InFlight:
    """The transition a rank is inside, and where in it."""

    trigger: Trigger
    epoch: int
    phase: str  # "plan", "guard" or "step"
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

    trigger: Trigger
    epoch: int
    source: State
    dest: State
    duration_s: float
    guard_s: float
    steps: tuple[StepResult, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved or 0 for s in self.steps)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A point-in-time view of one rank, for debugging (like anyio's ``statistics()``)."""

    rank: int
    world: int
    state: State
    epoch: int
    in_flight: InFlight | None
    trainer_paused: frozenset[str]
    engine_released: frozenset[str]
    failure: Failure | None


class _Model:
    """The object ``transitions`` decorates; never handed to users."""

    state: str


class Lifecycle:
    """One trainer rank's lifecycle over a trainer driver and an optional engine driver.

    With ``torch.distributed`` initialized, construction is collective: every
    rank must build its ``Lifecycle`` (it creates the guard's gloo group).
    """

    def __init__(
        self,
        *,
        trainer: TrainerDriver,
        engine: EngineDriver | None = None,
        config: LifecycleConfig | None = None,
        guard: Guard | None = None,
        trace_meta: Mapping[str, Any] | None = None,
    ) -> None:
        self._config = config or LifecycleConfig()
        self._trainer = trainer
        self._engine = engine
        self._guard = guard or Guard.from_default_group(timeout_s=self._config.guard.timeout_s)
        self._tracer: TraceSink = (
            Tracer(
                self._config.trace_dir,
                rank=self._guard.rank,
                world=self._guard.world,
                strategy=trainer.strategy.value,
                guard_timeout_s=self._guard.timeout_s,
                **dict(trace_meta or {}),
            )
            if self._config.trace_dir is not None
            else NullTracer()
        )
        self._model = _Model()
        self._machine = transitions.Machine(
            model=self._model,
            states=[s.value for s in State],
            transitions=[
                {"trigger": t.trigger.value, "source": t.source.value, "dest": t.dest.value}
                for t in DEFINITION.transitions
            ],
            initial=DEFINITION.initial.value,
            auto_transitions=False,
        )
        self._lock = threading.Lock()
        self._epoch = 0
        self._memory = {
            Side.TRAINER: MemoryLedger(Side.TRAINER.value, pause=trainer.pause_memory, resume=trainer.resume_memory),
            Side.ENGINE: MemoryLedger(
                Side.ENGINE.value,
                pause=engine.release_memory if engine is not None else _no_engine,
                resume=engine.resume_memory if engine is not None else _no_engine,
            ),
        }
        self._failure: Failure | None = None
        self._in_flight: InFlight | None = None
        self._recorded: tuple[int, TensorSet, dict[str, str]] | None = None
        self._actions: dict[StepKind, Callable[[Step, int], StepReport | None]] = {
            StepKind.BACKUP: self._backup,
            StepKind.RECORD_DIGESTS: self._record_digests,
            StepKind.PAUSE_MEMORY: self._pause_memory,
            StepKind.RESUME_MEMORY: self._resume_memory,
            StepKind.PUSH_WEIGHTS: self._push_weights,
            StepKind.CAST_MAIN_TO_PARAMS: lambda s, e: self._trainer.cast_main_to_params(),
            StepKind.RESTORE: self._restore,
            StepKind.PARAM_SYNC: lambda s, e: self._trainer.param_sync(),
            StepKind.VERIFY: self._verify,
        }

    # ------------------------------------------------------------------ facts

    @property
    def state(self) -> State:
        return State(self._model.state)

    @property
    def epoch(self) -> int:
        """The cycle number: 0 before the first offload, +1 at each offload."""
        return self._epoch

    @property
    def rank(self) -> int:
        return self._guard.rank

    @property
    def world(self) -> int:
        return self._guard.world

    @property
    def failure(self) -> Failure | None:
        return self._failure

    @property
    def paused_tags(self) -> Mapping[Side, frozenset[str]]:
        """Memory tags released now, per side. Tracked, because a failure can strand them."""
        return MappingProxyType({side: ledger.paused for side, ledger in self._memory.items()})

    @property
    def tracer(self) -> TraceSink:
        return self._tracer

    def allowed(self) -> tuple[Trigger, ...]:
        """Triggers that may fire now."""
        return () if self.state is State.FAILED else DEFINITION.allowed(self.state)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            rank=self.rank,
            world=self.world,
            state=self.state,
            epoch=self._epoch,
            in_flight=self._in_flight,
            trainer_paused=self._memory[Side.TRAINER].paused,
            engine_released=self._memory[Side.ENGINE].paused,
            failure=self._failure,
        )

    def verifies(self, epoch: int) -> bool:
        """Whether cycle ``epoch`` is checked bit-exact."""
        return self._config.verify.active(epoch)

    # --------------------------------------------------------------- triggers

    def start(self) -> TransitionResult:
        return self.fire(Trigger.START)

    def offload(self) -> TransitionResult:
        return self.fire(Trigger.OFFLOAD)

    def pause(self) -> TransitionResult:
        return self.fire(Trigger.PAUSE)

    def rematerialize(self) -> TransitionResult:
        return self.fire(Trigger.REMATERIALIZE)

    def sync(self) -> TransitionResult:
        return self.fire(Trigger.SYNC)

    def resume(self) -> TransitionResult:
        return self.fire(Trigger.RESUME)

    def fire(
        self,
        trigger: Trigger | str,
        *,
        before_guard: Callable[[], None] | None = None,
    ) -> TransitionResult:
        """Run one transition on this rank.

        ``before_guard`` runs after planning and before the guard; if it
        raises, the transition is abandoned cleanly (no collective entered,
        state unchanged). The async API uses it for cancellation.
        """
        trigger = Trigger(trigger)
        with self._lock:
            return self._fire(trigger, before_guard)

    def agree_on(self, step: str, collectives: tuple[Collective, ...]) -> float:
        """Guard a step outside the lifecycle (a train step) whose collectives are known.

        Every rank must call it with the same ``step``; ranks that plan other
        collectives, or hold another tensor set, raise ``RankDivergenceError``
        before any of them runs, and a rank that never comes is named by
        ``GuardTimeoutError``. The state does not change, also on failure: the
        caller decides what a failed step means. Returns the guard's seconds.
        """
        with self._lock:
            state = self.state.value
            if not (collectives and self._guard.active):
                return 0.0
            intent = self._intent(step, state, state, self._epoch, tuple(collectives))
            return self._agree(intent, {"epoch": self._epoch, "trigger": step, "state": state})

    def _agree(self, intent: Intent, base: dict[str, Any]) -> float:
        """Run the guard with its trace records; return its seconds."""
        emit = self._tracer.emit
        emit(
            "guard_entered",
            key=intent.key,
            collectives=[str(c) for c in intent.collectives],
            tensors=intent.tensors.digest,
            **base,
        )
        t0 = time.perf_counter()
        try:
            self._guard.agree(intent, state=base["state"])
        except BaseException as exc:
            extra = {k: getattr(exc, k) for k in ("missing", "culprits", "field", "groups") if hasattr(exc, k)}
            emit("guard_failed", **extra, **describe(exc), **base)
            raise
        seconds = time.perf_counter() - t0
        emit("guard_passed", duration_s=seconds, **base)
        return seconds

    def _fire(self, trigger: Trigger, before_guard: Callable[[], None] | None) -> TransitionResult:
        source = self.state
        transition = DEFINITION.transition(source, trigger)
        if transition is None:
            raise TransitionNotAllowed(
                source.value, trigger.value, [t.value for t in self.allowed()], self._failure and self._failure.error
            )
        epoch = self._epoch + 1 if trigger is Trigger.OFFLOAD else self._epoch
        started = time.perf_counter()
        self._in_flight = InFlight(trigger, epoch, "plan", None, time.monotonic())
        try:
            steps = tuple(s for s in transition.steps_for(self._trainer.strategy) if self._applies(s))
            collectives = tuple(c for s in steps for c in self._collectives(s))
            # The intent (and the tensor set, a walk over every tensor) is built
            # only when a guard will compare it: most transitions issue no collective.
            intent = (
                self._intent(trigger.value, source.value, transition.dest.value, epoch, collectives)
                if collectives and self._guard.active
                else None
            )
        except BaseException:
            # Nothing ran: the state is unchanged and nothing is in flight.
            self._in_flight = None
            raise
        emit = self._tracer.emit
        base = {"epoch": epoch, "trigger": trigger.value}
        emit("transition_started", state=source.value, dest=transition.dest.value, steps=[str(s) for s in steps], **base)
        guard_s = 0.0
        try:
            if before_guard is not None:
                before_guard()
        except BaseException as exc:
            self._in_flight = None
            emit("transition_cancelled", state=source.value, **base, **describe(exc))
            raise TransitionCancelled(trigger.value, epoch) from exc
        step_name: str | None = None
        results: list[StepResult] = []
        try:
            if intent is not None:
                self._in_flight = InFlight(trigger, epoch, "guard", None, time.monotonic())
                guard_s = self._agree(intent, {"state": source.value, **base})
            for step in steps:
                step_name = str(step)
                results.append(self._run_step(step, trigger, epoch, source, base))
        except BaseException as exc:
            self._fail(trigger, epoch, step_name, exc, source, base)
            raise
        # transitions re-checks the arrow: a table/engine mismatch raises here, loudly.
        getattr(self._model, "trigger")(trigger.value)
        self._epoch = epoch
        self._in_flight = None
        duration = time.perf_counter() - started
        emit("transition_finished", state=self.state.value, source=source.value, duration_s=duration, **base)
        return TransitionResult(trigger, epoch, source, transition.dest, duration, guard_s, tuple(results))

    def _applies(self, step: Step) -> bool:
        return self._engine is not None or (step.side is Side.TRAINER and step.kind is not StepKind.PUSH_WEIGHTS)

    def _intent(self, trigger: str, source: str, dest: str, epoch: int, collectives: tuple[Collective, ...]) -> Intent:
        from miles_fsm.plan import Intent

        return Intent(
            epoch=epoch,
            trigger=trigger,
            source=source,
            dest=dest,
            strategy=self._trainer.strategy.value,
            collectives=collectives,
            tensors=self._trainer.tensor_set(),
        )

    def _collectives(self, step: Step) -> tuple[Any, ...]:
        if step.side is Side.ENGINE or step.kind is StepKind.PUSH_WEIGHTS:
            return self._engine.collectives(step) if self._engine is not None else ()
        return self._trainer.collectives(step)

    def _run_step(self, step: Step, trigger: Trigger, epoch: int, source: State, base: dict[str, Any]) -> StepResult:
        name = str(step)
        self._in_flight = InFlight(trigger, epoch, "step", name, time.monotonic())
        mem_before = self._trainer.memory_in_use()
        self._tracer.emit("action_started", state=source.value, action=name, mem_before=mem_before, **base)
        t0 = time.perf_counter()
        report = self._actions[step.kind](step, epoch)
        duration = time.perf_counter() - t0
        moved = report.bytes_moved if report is not None else None
        host = report.host_bytes if report is not None else None
        self._tracer.emit(
            "action_finished",
            state=source.value,
            action=name,
            duration_s=duration,
            bytes_moved=moved,
            host_bytes=host,
            mem_before=mem_before,
            mem_after=self._trainer.memory_in_use(),
            **base,
        )
        return StepResult(name, duration, moved, host)

    def _fail(
        self, trigger: Trigger, epoch: int, step: str | None, exc: BaseException, source: State, base: dict[str, Any]
    ) -> None:
        phase = "guard" if step is None else "step"
        self._failure = Failure(trigger, epoch, step, exc)
        self._in_flight = None
        self._machine.set_state(State.FAILED.value, model=self._model)
        fields = describe(exc)
        if isinstance(exc, VerificationError):
            self._tracer.emit("verify_failed", state=source.value, tensors=list(exc.mismatched), where=exc.where, **base)
        self._tracer.emit(
            "transition_failed", state=State.FAILED.value, source=source.value, action=step, phase=phase, **fields, **base
        )
        if hasattr(exc, "add_note"):
            exc.add_note(f"miles-fsm: rank {self.rank} is now FAILED ({trigger.value}, epoch {epoch}, in {step or 'guard'})")
        try:
            self._guard.publish_failure(epoch, trigger.value, source.value, f"failed in {step or 'guard'} of")
        except RuntimeError as store_exc:  # the store's host may be gone; the trace still has it
            self._tracer.emit("store_unreachable", state=State.FAILED.value, **describe(store_exc), **base)

    # ----------------------------------------------------------------- recover

    def recover(self, to: State | str) -> None:
        """Leave FAILED, declaring what state memory is in.

        On the trainer side recovery only ever *pauses* memory (always
        safe). It refuses a target that needs trainer memory that is released
        now: the contents of a released tag are gone, so recover to PAUSED and
        rematerialize instead (or reload a checkpoint first). On the engine
        side it releases or resumes tags to match the target; engine weights
        resumed here are undefined until the next push, so after recovering to
        PAUSED, rematerialize before generating. The next guard checks that
        every rank recovered to the same place.
        """
        target = State(to)
        with self._lock:
            if self.state is not State.FAILED:
                raise RecoveryError(target=target.value, reason=f"the rank is {self.state.value}, not FAILED")
            if not target.in_cycle:
                raise RecoveryError(target=target.value, reason="only the five cycle states can be recovered to")
            trainer = self._memory[Side.TRAINER]
            lost = sorted(trainer.paused - target.trainer_paused_tags)
            if lost:
                raise RecoveryError(
                    target=target.value,
                    reason=f"trainer tags {lost} are released and their contents are gone; "
                    "recover to PAUSED and rematerialize, or reload them first",
                )
            trainer.pause(sorted(target.trainer_paused_tags - trainer.paused))
            if self._engine is not None:
                engine = self._memory[Side.ENGINE]
                engine.pause(sorted(target.engine_released_tags - engine.paused))
                engine.resume(sorted(engine.paused - target.engine_released_tags))
            failure = self._failure
            self._machine.set_state(target.value, model=self._model)
            self._failure = None
            self._recorded = None
            self._tracer.emit(
                "recovered",
                epoch=self._epoch,
                state=target.value,
                trigger=None,
                after=describe(failure.error) if failure else None,
            )

    def close(self) -> None:
        """Close the trace file. Idempotent."""
        self._tracer.close()

    def __enter__(self) -> "Lifecycle":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- actions

    def _pause_memory(self, step: Step, epoch: int) -> None:
        self._memory[step.side].pause(step.tags)

    def _resume_memory(self, step: Step, epoch: int) -> None:
        self._memory[step.side].resume(step.tags)

    def _backup(self, step: Step, epoch: int) -> StepReport | None:
        return _merge([self._trainer.backup(tag) for tag in step.tags])

    def _restore(self, step: Step, epoch: int) -> StepReport | None:
        return _merge([self._trainer.restore(tag) for tag in step.tags])

    def _record_digests(self, step: Step, epoch: int) -> None:
        if not self.verifies(epoch):
            self._recorded = None
            return
        tensors = self._trainer.tensors()
        self._recorded = (
            epoch,
            TensorSet.of(tensors.items()),
            digest_tensors(tensors, threads=self._config.verify.threads),
        )

    def _verify(self, step: Step, epoch: int) -> None:
        if self._recorded is None or self._recorded[0] != epoch:
            return
        _, before_set, before = self._recorded
        self._recorded = None
        tensors = self._trainer.tensors()
        after_set = TensorSet.of(tensors.items())
        if after_set != before_set:
            raise TensorSetChangedError(
                epoch=epoch,
                added=sorted(after_set.names - before_set.names),
                removed=sorted(before_set.names - after_set.names),
            )
        after = digest_tensors(tensors, threads=self._config.verify.threads)
        bad = sorted(n for n in before if before[n] != after[n])
        if bad:
            raise VerificationError(epoch=epoch, mismatched=bad)
        self._tracer.emit("verified", epoch=epoch, trigger=Trigger.RESUME.value, state=self.state.value, tensors=len(after))

    def _push_weights(self, step: Step, epoch: int) -> StepReport | None:
        assert self._engine is not None  # _applies() drops this step without an engine
        engine = self._engine
        named = list(self._trainer.named_weights())
        version = str(epoch)
        report = engine.update_weights(named, version=version)
        actual = engine.weight_version()
        if actual != version:
            raise WeightVersionError(engine=engine.name, expected=version, actual=actual)
        if self.verifies(epoch):
            served = engine.weight_digests()
            if served is not None:
                pushed = digest_tensors(dict(named), threads=self._config.verify.threads)
                if set(served) != set(pushed):
                    raise TensorSetChangedError(
                        epoch=epoch,
                        added=sorted(set(served) - set(pushed)),
                        removed=sorted(set(pushed) - set(served)),
                        where=f"engine {engine.name}",
                    )
                bad = sorted(n for n in pushed if pushed[n] != served[n])
                if bad:
                    raise VerificationError(epoch=epoch, mismatched=bad, where=f"engine {engine.name}")
        return report


def _no_engine(tag: str) -> None:
    raise RuntimeError("engine steps are skipped when the lifecycle has no engine")  # unreachable by design


def _merge(reports: list[StepReport | None]) -> StepReport | None:
    real = [r for r in reports if r is not None]
    if not real:
        return None
    from miles_fsm.drivers.protocols import StepReport

    def total(field: str) -> int | None:
        values = [getattr(r, field) for r in real if getattr(r, field) is not None]
        return sum(values) if values else None

    return StepReport(bytes_moved=total("bytes_moved"), host_bytes=total("host_bytes"))
