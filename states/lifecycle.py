"""``Lifecycle``: one rank's colocated memory lifecycle, run by the engine's ``Machine``.

The table is ``DEFINITION``; the step bodies are ``Actions``; this module
holds the rules that make it the colocated lifecycle:

- **planning**: which steps run (by weight strategy, and engine steps only
  with an engine), the collectives each declares, and the intent the guard
  compares, built from rank-uniform facts only (its parts: states/planning.py);
- **the epoch rule**: +1 at each ``offload``;
- **the recovery rule**: leaving FAILED only to a state whose memory is
  really there, never skipping a verification (its checks: states/recovery.py).

With ``torch.distributed`` initialized, construction is collective (the guard's gloo group); a rank
that never comes is named by ``PeerNeverJoinedError``, in the others' traces. Every state reached is
snapshotted for memory drift (states/drift.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from miles_fsm.config import LifecycleConfig
from miles_fsm.errors import PeerNeverJoinedError, describe
from miles_fsm.guard.consensus import Guard
from miles_fsm.machine import Failure, InFlight, Machine, Plan, PlannedStep, TransitionResult
from miles_fsm.replay.index import write_index
from miles_fsm.states.actions import Actions
from miles_fsm.states.audit import dump_beside_trace, make_audit
from miles_fsm.states.definition import CYCLE, DEFINITION, Side, State, Step, StepKind, Strategy, Trigger, steps_for
from miles_fsm.states.drift import DriftMonitor
from miles_fsm.states.planning import Intents, engine_side, shared
from miles_fsm.states.protocols import EngineDriver, TrainerDriver, check_driver
from miles_fsm.states.recovery import check_rebuilt, check_target, match_memory
from miles_fsm.trace.schema import GUARD_FAILED, RECOVERED, STORE_UNREACHABLE, TRACE_OPENED
from miles_fsm.trace.writer import NullTracer, Tracer, TraceSink, new_run_id

if TYPE_CHECKING:
    from miles_fsm.definition import Definition, Transition
    from miles_fsm.plan import Collective, Intent

__all__ = ["Lifecycle", "Snapshot"]


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

    def details(self) -> list[str]:
        """The lifecycle's own parts of a one-line description (the async snapshot adds its lock)."""
        return [
            f"trainer paused [{', '.join(sorted(self.trainer_paused))}]",
            f"engine released [{', '.join(sorted(self.engine_released))}]",
        ]


class Lifecycle:
    """One trainer rank's lifecycle over a trainer driver and an optional engine driver."""

    def __init__(
        self,
        *,
        trainer: TrainerDriver,
        engine: EngineDriver | None = None,
        config: LifecycleConfig | None = None,
        guard: Guard | None = None,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        sink: TraceSink | None = None,
        engine_leader: bool | None = None,
        trace_meta: Mapping[str, Any] | None = None,
    ) -> None:
        """``guard``, else one over ``group`` (None: the default group) and ``store``; see ``Guard.from_group``.

        ``sink`` replaces the file tracer of ``config.trace_dir`` with a trace sink of your own; it
        receives every record as ``emit(event, **fields)`` (``trace_opened`` included).

        ``engine_leader``: where one rank calls an engine for several (an engine's TP group),
        True on that rank and False on the others, which then never call the engine; after
        every engine step all ranks share its outcome, so they commit or fail together.
        None (the default): every rank calls its own engine, and nothing is shared.
        """
        check_driver(trainer, TrainerDriver, "trainer")
        if engine is not None:
            check_driver(engine, EngineDriver, "engine")
        self._config = config or LifecycleConfig()
        self._trainer = trainer
        self._intents = Intents(trainer)
        self._engine = engine
        strategy = trainer.strategy
        try:
            self._guard = guard or Guard.from_group(
                group, timeout_s=self._config.guard.longest_s, store=store, name=self._config.name
            )
        except PeerNeverJoinedError as exc:  # the wait, and who never came, go in this rank's trace
            self._trace_unbuilt(exc, group, strategy, sink, trace_meta or {})
            raise
        self._own_guard = self._guard if guard is None else None  # a guard passed in is the host's to close
        tracer = self._open_trace(strategy, sink, trace_meta or {})
        self._actions = Actions(trainer=trainer, engine=engine, verify=self._config.verify, tracer=tracer,
                                calls_engine=engine_leader is not False)  # fmt: skip
        table = self._actions.table
        share = engine_leader is not None and self._guard.active
        self._audit = make_audit(self._config.verify, self._guard)
        # Names and the step selection are fixed facts of the table and the
        # drivers: computed once here, not on every trigger.
        self._plans = {
            t.trigger: tuple(
                PlannedStep(str(s), s, self._audited(shared(table[s.kind], self._guard, t.trigger.value) if share and
                            engine_side(s) else table[s.kind], t.trigger, str(s), i == 0, i == len(steps) - 1))
                for steps in [self._steps(t, strategy)] for i, s in enumerate(steps)
            )
            for t in DEFINITION.transitions
        }  # fmt: skip
        self._drift = DriftMonitor(config=self._config.drift, rank=self._guard.rank, trainer=trainer, engine=engine,
                                   tracer=tracer)  # fmt: skip
        self._machine: Machine[State, Trigger] = Machine(
            definition=DEFINITION,
            planner=self._plan,
            next_epoch=_next_epoch,
            guard=self._guard,
            tracer=tracer,
            probe=trainer.memory_in_use,
            timeout_for=self._config.guard.timeout_for,
            on_commit=self._drift.observe,
            on_failure=lambda f: self.dump_flight_recorder(trigger=f.trigger.value, epoch=f.epoch, step=f.step,
                                                           error=type(f.error).__name__),
        )

    def _open_trace(self, strategy: Strategy, sink: TraceSink | None, extra: Mapping[str, Any]) -> TraceSink:
        # Shared by every rank, traced or not: sharing it is collective.
        run_id = self._guard.share_run_id(self._config.run_id or os.environ.get("MILES_FSM_RUN_ID") or None)
        self._run_id = run_id  # FR dumps carry it: replay leaves out other runs' dumps
        return self._tracer(strategy, sink, extra, rank=self._guard.rank, world=self._guard.world, run_id=run_id,
                            timeout_s=self._guard.timeout_s)  # fmt: skip

    def _trace_unbuilt(self, exc: PeerNeverJoinedError, group: dist.ProcessGroup | None, strategy: Strategy,
                       sink: TraceSink | None, extra: Mapping[str, Any]) -> None:  # fmt: skip
        """A trace of a lifecycle whose guard could not be built: what it waited for, and who never came."""
        # No run id can be shared (rank 0 may be the one missing): the given one, else this rank's own.
        run_id = self._config.run_id or os.environ.get("MILES_FSM_RUN_ID") or new_run_id()
        tracer = self._tracer(strategy, sink, extra, rank=dist.get_rank(group), world=dist.get_world_size(group),
                              run_id=run_id, timeout_s=exc.timeout_s)  # fmt: skip
        state = DEFINITION.initial.value
        tracer.emit(GUARD_FAILED, epoch=0, state=state, trigger="build", **describe(exc))
        tracer.close(epoch=0, state=state, error=exc)

    def _tracer(self, strategy: Strategy, sink: TraceSink | None, extra: Mapping[str, Any], *, rank: int, world: int,
                run_id: str, timeout_s: float) -> TraceSink:  # fmt: skip
        meta = {
            "strategy": strategy.value,
            "guard_timeout_s": timeout_s,
            "lifecycle": self._config.name,
            "drift": self._config.drift.traced(),
            "machine": DEFINITION.describe(steps=lambda t: [str(s) for s in self._steps(t, strategy)]),
            **extra,
        }
        if sink is not None:
            sink.emit(TRACE_OPENED, epoch=0, state=None, trigger=None, run=run_id, rank=rank, world=world, **meta)
            return sink
        trace_dir = self._trace_dir
        if trace_dir is None:
            return NullTracer()
        # The index beside a closed trace: replay reads it instead of the lines while the file is unchanged.
        return Tracer(trace_dir, rank=rank, world=world, run=run_id, on_close=write_index, **meta)

    @property
    def _trace_dir(self) -> Path | None:
        # Several lifecycles of one job (actor, ref, critic) trace into folders of their own.
        d = self._config.trace_dir
        return d / self._config.name if d is not None and self._config.name else d

    # ------------------------------------------------------------------ facts

    @property
    def definition(self) -> Definition[State, Trigger]:
        return DEFINITION

    @property
    def cycle(self) -> tuple[Trigger, ...]:
        """The triggers of one offload/wake cycle, from TRAINING back to it."""
        return CYCLE

    @property
    def state(self) -> State:
        return self._machine.state

    @property
    def epoch(self) -> int:
        """The cycle number: 0 before the first offload, +1 at each offload."""
        return self._machine.epoch

    rank = property(lambda self: self._guard.rank, doc="This rank's number.")
    world = property(lambda self: self._guard.world, doc="How many ranks.")
    drift = property(lambda self: self._drift, doc="The memory drift check: its snapshots and findings (states/drift.py).")

    @property
    def failure(self) -> Failure | None:
        return self._machine.failure

    @property
    def paused_tags(self) -> Mapping[Side, frozenset[str]]:
        """Memory tags released now, per side. Tracked, because a failure can strand them."""
        return MappingProxyType({side: ledger.paused for side, ledger in self._actions.memory.items()})

    @property
    def tracer(self) -> TraceSink:
        return self._machine.tracer

    @property
    def guard(self) -> Guard:
        """The consensus guard every transition agrees through (the one given, or the one built)."""
        return self._guard

    def allowed(self) -> tuple[Trigger, ...]:
        """Triggers that may fire now."""
        return self._machine.allowed()

    def snapshot(self) -> Snapshot:
        memory = self._actions.memory
        return Snapshot(
            rank=self.rank,
            world=self.world,
            state=self.state,
            epoch=self.epoch,
            in_flight=self._machine.in_flight,
            trainer_paused=memory[Side.TRAINER].paused,
            engine_released=memory[Side.ENGINE].paused,
            failure=self.failure,
        )

    def verifies(self, epoch: int) -> bool:
        """Whether cycle ``epoch`` is checked bit-exact."""
        return self._actions.verifies(epoch)

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

    def fire(self, trigger: Trigger | str, *, before_guard: Callable[[], None] | None = None) -> TransitionResult:
        """Run one transition on this rank.

        ``before_guard`` runs after planning and before the guard; if it
        raises, the transition is abandoned cleanly (no collective entered,
        state unchanged). The async API uses it for cancellation.
        """
        return self._machine.fire(Trigger(trigger), before_guard=before_guard)

    def agree_on(self, step: str, collectives: tuple[Collective, ...]) -> float:
        """Guard a step outside the lifecycle (a train step) whose collectives are known.

        Every rank must call it with the same ``step``; ranks that plan other
        collectives, or hold another tensor set, raise ``RankDivergenceError``
        before any of them runs, and a rank that never comes is named by
        ``GuardTimeoutError``. The state does not change, also on failure: the
        caller decides what a failed step means. Returns the guard's seconds.
        """
        with self._machine.lock:
            state = self.state.value
            if not (collectives and self._guard.active):
                return 0.0  # nothing here can hang: only a collective waits on the others
            intent = self._intent(step, state, state, self.epoch, tuple(collectives))
            return self._machine.agree(intent, {"epoch": self.epoch, "trigger": step, "state": state})

    # ------------------------------------------------------------ plan audit

    def _audited(self, action: Callable[[Step, int], Any], trigger: Trigger, name: str, first: bool,
                 last: bool) -> Callable[[Step, int], Any]:  # fmt: skip
        if self._audit is None:
            return action
        return self._audit.wrap(action, self._collectives, trigger=trigger.value, name=name, first=first, last=last)

    def dump_flight_recorder(self, **meta: Any) -> Path | None:
        """Write this rank's Flight Recorder beside its trace (``fr-rank-<r>.json``), for replay.

        None when the recorder is off or nothing is traced to a directory.
        Every failed transition calls it; call it on a failure outside one
        (a train step's collective timing out).
        """
        return dump_beside_trace(self._trace_dir, self._guard, run=self._run_id, **meta)

    # --------------------------------------------------------------- planning

    def _steps(self, t: Transition[State, Trigger], strategy: Strategy) -> tuple[Step, ...]:
        return tuple(s for s in steps_for(t, strategy) if self._applies(s))

    def _plan(self, transition: Transition[State, Trigger], epoch: int) -> Plan:
        steps = self._plans[transition.trigger]
        collectives = tuple(c for p in steps for c in self._collectives(p.step))
        # The intent (and the tensor set, a walk over every tensor) is built
        # only when a guard will compare it.
        if not self._guard.active or not (collectives or self._config.guard.every_transition):
            return Plan(steps)
        intent = self._intent(transition.trigger.value, transition.source.value, transition.dest.value, epoch,
                              collectives)  # fmt: skip
        return Plan(steps, intent)

    def _applies(self, step: Step) -> bool:
        return self._engine is not None or (step.side is Side.TRAINER and step.kind is not StepKind.PUSH_WEIGHTS)

    def _intent(self, trigger: str, source: str, dest: str, epoch: int, collectives: tuple[Collective, ...]) -> Intent:
        # Walked once per structure version (states/planning.py), and again on every verified cycle
        # (epoch 0, before the first offload, is no cycle: its first walk is the start's).
        return self._intents.get(trigger, source, dest, epoch, collectives,
                                 check=epoch > 0 and self._actions.verifies(epoch))  # fmt: skip

    def _collectives(self, step: Step) -> tuple[Any, ...]:
        if engine_side(step):
            return self._engine.collectives(step) if self._engine is not None else ()
        return self._trainer.collectives(step)

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
        with self._machine.lock:
            memory = self._actions.memory
            check_target(self.state, target, memory[Side.TRAINER])
            failure = self._machine.failure
            planned = self._plans[Trigger(failure.trigger)] if failure is not None else ()
            check_rebuilt(failure, planned, memory[Side.TRAINER], target, self._actions.pending_verification)
            match_memory(target, memory, engine=self._engine is not None)
            # Recorded digests stay: the next resume of this epoch verifies against them.
            failure = self._machine.leave_failed(target)
            try:  # peers must not blame the failure left behind; the store's host may be gone
                self._guard.publish_recovered(self.epoch, failure.trigger.value if failure else "", target.value)
            except RuntimeError as store_exc:
                self.tracer.emit(STORE_UNREACHABLE, epoch=self.epoch, state=target.value, trigger=None,
                                 **describe(store_exc))  # fmt: skip
            self.tracer.emit(
                RECOVERED,
                epoch=self.epoch,
                state=target.value,
                trigger=None,
                after=describe(failure.error) if failure else None,
            )

    def close(self, error: BaseException | None = None) -> None:
        """Write the trace's end record (``error``: why the run ends outside any transition; replay then does not
        call it healthy), close the trace, then stop the guard's publisher thread. Idempotent."""
        # The record first: a stopped rank's grace is bounded, and the publisher's join may wait on the store.
        try:
            self.tracer.close(epoch=self.epoch, state=self.state.value, error=error)
        finally:
            if self._own_guard is not None:
                self._own_guard.close()

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(error=exc)


def _next_epoch(trigger: Trigger, epoch: int) -> int:
    """The epoch rule: a cycle begins at each offload."""
    return epoch + 1 if trigger is Trigger.OFFLOAD else epoch

