"""The async API (miles_fsm.aio.machine) in one process, on asyncio and trio.

Multi-rank cancellation is in test_aio_ranks.py; pytest-asyncio use in
test_aio_pytest_asyncio.py.
"""

from __future__ import annotations

import hashlib
import threading
import time

import anyio
import orjson
import pytest
from anyio import wait_all_tasks_blocked
from anyio.lowlevel import checkpoint
from miles_fsm.states import State, Trigger
from toy import ToyEngine, ToyTrainer

from miles_fsm.aio.machine import StateChange
from miles_fsm.states.aio import AsyncLifecycle
from miles_fsm.config import LifecycleConfig
from miles_fsm.errors import RankFailedError, TransitionNotAllowed
from miles_fsm.states.lifecycle import Lifecycle

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


class GatedTrainer(ToyTrainer):
    """A ToyTrainer that can hold one call until released, and says when it got there.

    ``hold`` names the call: ``"plan"`` (the collective plan, read while
    planning, before the guard) or a step as ToyTrainer records it (``"backup:actor"``,
    ``"param_sync"``). One-shot: it holds the next such call only. ``hold_s``
    bounds the hold (None: until ``release`` is set).
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hold: str | None = None
        self.hold_s: float | None = None
        self.reached = threading.Event()
        self.release = threading.Event()
        self.busy_s = 0.0  # CPU work done in backup(actor), for the responsiveness test

    def arm(self, call: str, *, hold_s: float | None = None) -> None:
        self.hold, self.hold_s = call, hold_s
        self.reached.clear()
        self.release.clear()

    def _held(self, call: str) -> None:
        if self.hold == call:
            self.hold = None
            self.reached.set()
            self.release.wait(self.hold_s)

    def _call(self, name: str) -> None:
        self._held(name)
        super()._call(name)
        if name == "backup:actor" and self.busy_s:
            _hash_for(self.busy_s)

    def collectives(self, step):
        self._held("plan")
        return super().collectives(step)


def _hash_for(seconds: float) -> None:
    """Real CPU work (SHA256 of 8 MiB blocks, as verification does) for at least ``seconds``."""
    block = bytes(8 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(block).digest()


def _build(tmp_path=None, **kw) -> tuple[GatedTrainer, AsyncLifecycle]:
    trainer = GatedTrainer(**kw)
    config = LifecycleConfig(trace_dir=tmp_path) if tmp_path is not None else None
    return trainer, AsyncLifecycle(Lifecycle(trainer=trainer, engine=ToyEngine(), config=config))


def _events(tmp_path) -> list[dict]:
    return [orjson.loads(line) for line in (tmp_path / "rank-0.jsonl").read_bytes().splitlines()]


async def _until(event: threading.Event) -> None:
    """Wait for a worker thread to reach a point, without blocking the loop (no sleep-polling)."""
    await anyio.to_thread.run_sync(event.wait)


async def test_triggers_run_the_cycle_and_every_watcher_sees_each_change_in_order():
    """Awaitable triggers move the state; two concurrent change iterators each receive every change,
    in order, with the trigger and the result; advance_to walks the table."""
    _, alc = _build()
    seen: dict[str, list[StateChange]] = {"a": [], "b": []}

    async def watch(name: str, changes) -> None:
        with changes:
            async for change in changes:
                seen[name].append(change)
                if len(seen[name]) == 7:
                    return

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, "a", alc.changes())
        tg.start_soon(watch, "b", alc.changes())
        result = await alc.start()
        assert result.dest is State.TRAINING and alc.state is State.TRAINING
        await alc.offload()
        await alc.pause()
        await alc.rematerialize()
        await alc.sync()
        await alc.resume()
        results = await alc.advance_to(State.OFFLOADED)
        assert [r.trigger for r in results] == [Trigger.OFFLOAD]
    expected = [
        (State.INITIAL, State.TRAINING, Trigger.START),
        (State.TRAINING, State.OFFLOADED, Trigger.OFFLOAD),
        (State.OFFLOADED, State.PAUSED, Trigger.PAUSE),
        (State.PAUSED, State.REMATERIALIZED, Trigger.REMATERIALIZE),
        (State.REMATERIALIZED, State.SYNCED, Trigger.SYNC),
        (State.SYNCED, State.TRAINING, Trigger.RESUME),
        (State.TRAINING, State.OFFLOADED, Trigger.OFFLOAD),
    ]
    for name in ("a", "b"):
        assert [(c.source, c.dest, c.trigger) for c in seen[name]] == expected
        assert all(c.result is not None and c.result.dest is c.dest for c in seen[name])
    assert [c.epoch for c in seen["a"]] == [0, 1, 1, 1, 1, 1, 2]
    assert alc.snapshot().watchers == 0  # both unsubscribed on leaving their with-blocks


@pytest.mark.slow
async def test_event_loop_keeps_ticking_during_a_one_second_transition():
    """A transition whose step does >= 1 s of CPU work runs in a worker thread: a 5 ms ticker keeps
    running; 99% of its gaps stay under 50 ms and the worst under 250 ms (a blocked loop stalls the whole
    1 s; the margin is for a 2-core machine under load, where the OS alone can delay a tick)."""
    trainer, alc = _build()
    await alc.start()
    trainer.busy_s = 1.0
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await anyio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await wait_all_tasks_blocked()
        result = await alc.offload()
        done = True
    assert result.duration_s >= 1.0
    assert len(gaps) > 100, "the ticker barely ran"
    p99 = sorted(gaps)[int(len(gaps) * 0.99)]
    assert p99 < 0.050, f"99th-percentile loop stall {p99 * 1e3:.1f} ms"
    assert max(gaps) < 0.250, f"worst loop stall {max(gaps) * 1e3:.1f} ms"


async def test_a_new_trigger_queues_behind_the_running_transition_and_never_cancels_it():
    """Unlike transitions' AsyncMachine, firing while a transition runs does not abandon it: the
    second trigger waits on the per-rank lock (visible in snapshot()), and both run, in order."""
    trainer, alc = _build()
    await alc.start()
    trainer.arm("backup:actor")
    order: list[str] = []

    async def fire(trigger: str) -> None:
        await alc.fire(trigger)
        order.append(trigger)

    async with anyio.create_task_group() as tg:
        tg.start_soon(fire, "offload")
        await _until(trainer.reached)
        tg.start_soon(fire, "pause")
        await wait_all_tasks_blocked()
        snap = alc.snapshot()
        assert snap.running == "offload" and snap.queued == ("pause",)
        assert snap.in_flight is not None
        assert (snap.in_flight.trigger, snap.in_flight.phase, snap.in_flight.step) == (
            Trigger.OFFLOAD,
            "step",
            "backup(actor)",
        )
        assert snap.in_flight.since_mono <= time.monotonic()
        assert snap.state is State.TRAINING and snap.epoch == 0
        assert "in offload (step backup(actor)" in str(snap) and "queued: pause" in str(snap)
        trainer.release.set()
    assert order == ["offload", "pause"]
    assert alc.state is State.PAUSED
    assert trainer.calls[-1] == "pause:param_buffer"
    snap = alc.snapshot()
    assert (snap.running, snap.queued, snap.in_flight) == (None, (), None)
    assert snap.trainer_paused == frozenset({"param_buffer", "grad_buffer", "default"})


async def test_cancel_before_the_guard_abandons_the_transition_cleanly(tmp_path):
    """A task cancelled while its transition is still planning abandons it at the before_guard hook:
    no step runs, the state is unchanged, the trace says transition_cancelled, the cancellation
    reaches the cancel scope, and the next trigger runs normally."""
    trainer, alc = _build(tmp_path)
    await alc.start()
    calls_before = list(trainer.calls)
    trainer.arm("plan")
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_when_planning() -> None:
                await _until(trainer.reached)
                scope.cancel()
                trainer.release.set()

            tg.start_soon(cancel_when_planning)
            await alc.offload()
            pytest.fail("offload returned although its task was cancelled")
    assert scope.cancelled_caught
    await checkpoint()  # no stray cancellation is left pending
    assert alc.state is State.TRAINING and alc.epoch == 0
    assert trainer.calls == calls_before
    events = [e["event"] for e in _events(tmp_path) if e.get("trigger") == "offload"]
    assert events == ["transition_started", "transition_cancelled"]
    await alc.offload()
    assert alc.state is State.OFFLOADED


async def test_cancel_after_the_point_of_no_return_finishes_the_transition_then_delivers(tmp_path):
    """A task cancelled while its transition runs a step does not abandon it: the task waits
    (shielded) until the transition finished, the state moved and watchers were told; only then
    does the cancellation arrive. The trace records cancel_deferred."""
    trainer, alc = _build(tmp_path)
    await alc.start()
    trainer.arm("backup:actor")
    state_when_cancelled: list[State] = []
    with alc.changes() as changes:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_in_step() -> None:
                    await _until(trainer.reached)
                    scope.cancel()
                    with anyio.CancelScope(shield=True):
                        await wait_all_tasks_blocked()
                        state_when_cancelled.append(alc.state)
                    trainer.release.set()

                tg.start_soon(cancel_in_step)
                try:
                    await alc.offload()
                finally:
                    state_when_cancelled.append(alc.state)
        change = await changes.__anext__()
    assert scope.cancelled_caught
    # Still TRAINING while the step was held (the task had not given up), OFFLOADED when it ended.
    assert state_when_cancelled == [State.TRAINING, State.OFFLOADED]
    assert alc.state is State.OFFLOADED and alc.epoch == 1
    assert trainer.calls[-2:] == ["pause:grad_buffer", "pause:default"]
    assert (change.source, change.dest) == (State.TRAINING, State.OFFLOADED)
    records = [e for e in _events(tmp_path) if e.get("trigger") == "offload"]
    names = [e["event"] for e in records]
    assert "cancel_deferred" in names and names[-1] == "transition_finished"
    deferred = next(e for e in records if e["event"] == "cancel_deferred")
    assert (deferred["phase"], deferred["action"]) == ("step", "backup(actor)")
    await alc.pause()  # the lock was released; the rank goes on
    assert alc.state is State.PAUSED


async def test_a_timeout_before_the_guard_abandons_and_raises_timeout_error():
    """fail_after expiring while the transition is still planning abandons it: TimeoutError, no
    step ran, state unchanged."""
    trainer, alc = _build()
    await alc.start()
    calls_before = list(trainer.calls)
    trainer.arm("plan", hold_s=0.5)
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await alc.offload()
    assert alc.state is State.TRAINING and trainer.calls == calls_before
    assert time.perf_counter() - started >= 0.5  # it still waited for the thread to leave the lifecycle


async def test_a_timeout_after_the_point_of_no_return_lets_the_transition_finish():
    """fail_after expiring during a step: the transition completes (state OFFLOADED, every step
    ran), and the TimeoutError comes afterwards."""
    trainer, alc = _build()
    await alc.start()
    trainer.arm("backup:actor", hold_s=0.3)
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await alc.offload()
    assert time.perf_counter() - started >= 0.3
    assert alc.state is State.OFFLOADED
    assert trainer.calls[-3:] == ["backup:actor", "pause:grad_buffer", "pause:default"]


async def test_wait_for_returns_when_the_state_is_reached():
    """wait_for(PAUSED) blocks through OFFLOADED and returns once pause() finished; wait_for of
    the current state returns at once."""
    _, alc = _build()
    await alc.start()
    await alc.wait_for(State.TRAINING)
    reached: list[State] = []

    async def rollout_task() -> None:
        await alc.wait_for(State.PAUSED)
        reached.append(alc.state)

    async with anyio.create_task_group() as tg:
        tg.start_soon(rollout_task)
        await wait_all_tasks_blocked()
        await alc.offload()
        await wait_all_tasks_blocked()
        assert reached == []
        await alc.pause()
    assert reached == [State.PAUSED]


async def test_a_failed_rank_wakes_waiters_with_rank_failed_error_and_recover_is_published():
    """When a step raises, the firing task gets the error, the rank is FAILED, waiters get
    RankFailedError naming the transition and step, watchers see the FAILED change; recover()
    leaves FAILED and is published too."""
    trainer, alc = _build()
    await alc.start()
    trainer.fail_on = "backup:actor"
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await alc.wait_for(State.PAUSED)
        except RankFailedError as exc:
            errors.append(exc)

    with alc.changes() as changes:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_all_tasks_blocked()
            with pytest.raises(RuntimeError, match="injected failure in backup:actor"):
                await alc.offload()
        failed = await changes.__anext__()
        assert alc.state is State.FAILED and failed.failed and failed.trigger is Trigger.OFFLOAD
        assert isinstance(failed.error, RuntimeError)
        (err,) = errors
        assert (err.trigger, err.step, err.waiting_for, err.epoch) == ("offload", "backup(actor)", "PAUSED", 1)
        assert "recover" in str(err)
        with pytest.raises(RankFailedError):
            await alc.wait_for(State.PAUSED)  # already FAILED: raises at once
        with pytest.raises(TransitionNotAllowed):
            await alc.pause()
        trainer.fail_on = None
        await alc.recover(State.TRAINING)
        back = await changes.__anext__()
    assert (back.source, back.dest, back.trigger) == (State.FAILED, State.TRAINING, None)
    await alc.offload()
    assert alc.state is State.OFFLOADED


async def test_rollout_window_gives_the_engine_the_gpu_and_takes_it_back():
    """Entering rollout() offloads and pauses (pushing weights); leaving rematerializes, syncs and
    resumes, back to TRAINING."""
    trainer, alc = _build()
    await alc.start()
    async with alc.rollout() as window:
        assert alc.state is State.PAUSED
        assert window.epoch == 1 and [r.trigger for r in window.entered] == [Trigger.OFFLOAD, Trigger.PAUSE]
        assert alc.lifecycle.paused_tags  # the engine has its memory now
    assert alc.state is State.TRAINING
    assert "cast_main_to_params" in trainer.calls and "param_sync" in trainer.calls


async def test_rollout_window_takes_the_gpu_back_when_the_body_raises_or_is_cancelled():
    """Leaving rollout() runs rematerialize, sync and resume also when the body raises (the error
    propagates) and when the body is cancelled (leaving is shielded; the cancellation follows)."""
    _, alc = _build()
    await alc.start()
    with pytest.raises(ValueError, match="generation failed"):
        async with alc.rollout():
            raise ValueError("generation failed")
    assert alc.state is State.TRAINING and alc.epoch == 1
    with anyio.CancelScope() as scope:
        async with alc.rollout():
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert alc.state is State.TRAINING and alc.epoch == 2


async def test_rollout_refuses_to_start_outside_training():
    """rollout() from a state that is not TRAINING or OFFLOADED raises TransitionNotAllowed and
    fires nothing."""
    trainer, alc = _build()
    with pytest.raises(TransitionNotAllowed, match="'rollout' is not allowed in state INITIAL"):
        async with alc.rollout():
            pytest.fail("the body ran")
    assert alc.state is State.INITIAL and trainer.calls == []


async def test_cancel_while_queued_on_the_lock_fires_nothing():
    """A task cancelled while it waits behind another transition leaves the queue and never fires."""
    trainer, alc = _build()
    await alc.start()
    trainer.arm("backup:actor")
    async with anyio.create_task_group() as tg:
        tg.start_soon(alc.offload)
        await _until(trainer.reached)
        with anyio.CancelScope() as scope:
            tg.start_soon(alc.pause)  # queued behind offload
            await wait_all_tasks_blocked()
            assert alc.snapshot().queued == ("pause",)
            queued = anyio.CancelScope()

            async def queued_pause() -> None:
                with queued:
                    await alc.resume()

            tg.start_soon(queued_pause)
            await wait_all_tasks_blocked()
            assert alc.snapshot().queued == ("pause", "resume")
            queued.cancel()
            await wait_all_tasks_blocked()
            assert alc.snapshot().queued == ("pause",)
            trainer.release.set()
        assert not scope.cancelled_caught
    assert alc.state is State.PAUSED  # resume would have raised TransitionNotAllowed had it fired


async def test_agree_on_runs_in_the_ranks_queue_and_returns_the_guard_time():
    """AsyncLifecycle.agree_on guards a train step from async code: it waits its turn behind a running
    transition (never interleaving with it) and leaves the state alone."""
    from miles_fsm.plan import Collective

    trainer, alc = _build()
    await alc.start()
    order: list[str] = []

    async def offload() -> None:
        await alc.offload()
        order.append("offload")

    async def agree() -> None:
        seconds = await alc.agree_on("train", (Collective("all_reduce", "dp", "float32", 8),))
        order.append(f"agree:{seconds:g}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(offload)
        await wait_all_tasks_blocked()
        tg.start_soon(agree)
    assert order == ["offload", "agree:0"]  # world 1: nothing to agree with, so no wait
    assert alc.state is State.OFFLOADED


async def test_a_move_that_a_drift_error_follows_is_still_published():
    """Under ``DriftConfig(policy="raise")`` the drift check raises after its transition committed: the caller
    gets ``MemoryDriftError``, and watchers still see the rank's move, since it happened."""
    from test_drift import MiB, LeakyTrainer, _lifecycle

    from miles_fsm.config import DriftConfig
    from miles_fsm.states import Strategy
    from miles_fsm.states.errors import MemoryDriftError

    lc, trainer = _lifecycle(Strategy.BACKUP, DriftConfig(policy="raise", abs_bytes=3 * MiB, rel=0.0),
                             trainer_cls=LeakyTrainer)  # fmt: skip
    trainer.leak_from = 3
    alc = AsyncLifecycle(lc)
    with alc.changes() as changes:
        await alc.start()
        with pytest.raises(MemoryDriftError):
            for _ in range(10):
                trainer.epoch_seen = lc.epoch + 1
                await alc.offload()
                await alc.pause()
                await alc.advance_to(State.TRAINING)
        assert lc.state is not State.FAILED
        with anyio.fail_after(5):
            async for change in changes:
                if (change.dest, change.epoch) == (lc.state, lc.epoch):
                    break
    assert change.source is not change.dest and change.result is None and not change.failed
