"""Cancellation and timeouts of the async API in real 2-rank gloo runs.

Each rank runs ``anyio.run`` in its own process; the two ranks use different
backends (asyncio and trio), so both are covered in every run.
"""

from __future__ import annotations

import time

import anyio
import orjson
import pytest
import torch.distributed as dist
from miles_fsm.states import State
from test_aio import GatedTrainer
from toy import ToyEngine

from miles_fsm.states.aio import AsyncLifecycle
from miles_fsm.config import GuardConfig, LifecycleConfig
from miles_fsm.errors import GuardTimeoutError
from miles_fsm.launch.local import RankContext, run_ranks
from miles_fsm.states.lifecycle import Lifecycle

pytestmark = pytest.mark.slow

GUARD_TIMEOUT_S = 2.0
_DONE_KEY = "test_aio/rank0_done"


def _lifecycle(ctx: RankContext) -> tuple[GatedTrainer, AsyncLifecycle]:
    trainer = GatedTrainer()
    config = LifecycleConfig(guard=GuardConfig(timeout_s=GUARD_TIMEOUT_S), trace_dir=ctx.kwargs["trace_dir"])
    return trainer, AsyncLifecycle(Lifecycle(trainer=trainer, engine=ToyEngine(), config=config))


def _hold_until_rank0_is_done(ctx: RankContext) -> None:
    # Rank 1 stays alive until rank 0's guard has timed out, so rank 0 sees a
    # missing rank (GuardTimeoutError), not a lost connection.
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 0:
        store.set(_DONE_KEY, b"1")
    else:
        store.wait([_DONE_KEY])


async def _sync_abandoned_before_guard(alc: AsyncLifecycle, trainer: GatedTrainer, rank: int, mode: str) -> dict:
    await alc.advance_to(State.REMATERIALIZED)  # the toy trainer's first collective is sync's param all-gather
    if rank == 0:
        started = time.monotonic()
        try:
            await alc.sync()
        except GuardTimeoutError as exc:
            return {"error": type(exc).__name__, "missing": list(exc.missing), "after_s": time.monotonic() - started}
        return {"error": None}
    if mode == "cancel":
        trainer.arm("plan")
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_while_planning() -> None:
                    await anyio.to_thread.run_sync(trainer.reached.wait)
                    scope.cancel()
                    trainer.release.set()

                tg.start_soon(cancel_while_planning)
                await alc.sync()
    else:
        trainer.arm("plan", hold_s=0.5)
        with anyio.move_on_after(0.1) as scope:
            await alc.sync()
    return {"cancelled": scope.cancelled_caught, "state": alc.state.value}


def abandon_before_guard(ctx: RankContext) -> dict:
    """Rank 1 abandons sync before its guard (kwargs mode: cancel or timeout); rank 0 reports its guard."""
    trainer, alc = _lifecycle(ctx)
    out = anyio.run(
        _sync_abandoned_before_guard,
        alc,
        trainer,
        ctx.rank,
        ctx.kwargs["mode"],
        backend=ctx.kwargs["backends"][ctx.rank],
    )
    _hold_until_rank0_is_done(ctx)
    return {**out, "calls": trainer.calls}


async def _sync_cancelled_after_guard(alc: AsyncLifecycle, trainer: GatedTrainer, rank: int) -> dict:
    await alc.advance_to(State.REMATERIALIZED)
    trainer.arm("param_sync", hold_s=0.8)  # both ranks: the step after the guard takes 0.8 s
    seen: list[str] = []
    started = time.monotonic()
    if rank == 0:  # a timeout that expires during the step
        try:
            with anyio.fail_after(0.2):
                await alc.sync()
        except TimeoutError:
            seen.append(f"TimeoutError in {alc.state.value}")
    else:  # a cancellation while the step runs
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_in_step() -> None:
                    await anyio.to_thread.run_sync(trainer.reached.wait)
                    scope.cancel()

                tg.start_soon(cancel_in_step)
                try:
                    await alc.sync()
                finally:
                    seen.append(f"cancelled in {alc.state.value}")
        assert scope.cancelled_caught
    delivered_after_s = time.monotonic() - started
    await alc.resume()  # verify runs: the rank is healthy and goes on
    return {
        "seen": seen,
        "delivered_after_s": delivered_after_s,
        "state": alc.state.value,
        "w": trainer.params["w"].float().sum().item(),
    }


def cancel_after_guard(ctx: RankContext) -> dict:
    """Both ranks pass sync's guard; then rank 0 times out and rank 1 is cancelled during the step."""
    trainer, alc = _lifecycle(ctx)
    out = anyio.run(_sync_cancelled_after_guard, alc, trainer, ctx.rank, backend=ctx.kwargs["backends"][ctx.rank])
    return {**out, "calls": trainer.calls}


def _records(trace_dir, rank: int) -> list[dict]:
    return [orjson.loads(line) for line in (trace_dir / f"rank-{rank}.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize(
    ("mode", "backends"),
    [("cancel", ("asyncio", "trio")), ("timeout", ("trio", "asyncio"))],
)
def test_abandoning_before_the_guard_makes_the_peer_time_out_naming_the_rank(
    mode, backends, tmp_path, assert_no_leftovers
):
    """Rank 1's sync is cancelled (or times out) while planning: rank 1 enters no collective and
    keeps its state; rank 0 gets GuardTimeoutError naming rank 1 within the guard timeout + 2 s."""
    out = run_ranks(
        abandon_before_guard,
        2,
        timeout_s=30,
        kwargs={"mode": mode, "backends": backends, "trace_dir": str(tmp_path)},
    )
    assert all(o.ok for o in out), [o.error for o in out]
    r0, r1 = (o.result for o in out)
    assert r0["error"] == "GuardTimeoutError" and r0["missing"] == [1]
    assert GUARD_TIMEOUT_S * 0.9 <= r0["after_s"] < GUARD_TIMEOUT_S + 2.0
    assert r1["cancelled"] is True and r1["state"] == "REMATERIALIZED"
    assert "param_sync" not in r1["calls"]
    sync = [x["event"] for x in _records(tmp_path, 1) if x["trigger"] == "sync"]
    assert sync == ["transition_started", "transition_cancelled"]  # no guard_entered: no collective
    assert "guard_entered" in [x["event"] for x in _records(tmp_path, 0) if x["trigger"] == "sync"]


def test_cancel_or_timeout_after_the_guard_completes_on_every_rank_then_delivers(tmp_path, assert_no_leftovers):
    """Once sync's guard has passed, rank 0's timeout and rank 1's cancellation wait for the
    transition: both ranks reach SYNCED with identical params, the cancellation arrives only then
    (after the 0.8 s step), and both ranks go on to resume."""
    out = run_ranks(
        cancel_after_guard, 2, timeout_s=30, kwargs={"backends": ("trio", "asyncio"), "trace_dir": str(tmp_path)}
    )
    assert all(o.ok for o in out), [o.error for o in out]
    r0, r1 = (o.result for o in out)
    assert r0["seen"] == ["TimeoutError in SYNCED"]
    assert r1["seen"] == ["cancelled in SYNCED"]
    for r in (r0, r1):
        assert r["delivered_after_s"] >= 0.8
        assert r["state"] == "TRAINING"
        assert r["calls"].count("param_sync") == 1
    assert r0["w"] == r1["w"]
    for rank in (0, 1):
        events = [x["event"] for x in _records(tmp_path, rank) if x["trigger"] == "sync"]
        assert events[:3] == ["transition_started", "guard_entered", "guard_passed"]
        assert "cancel_deferred" in events and events[-1] == "transition_finished"
