"""The async API under pytest-asyncio and native asyncio cancellation.

Users on plain asyncio cancel with ``task.cancel()``, ``asyncio.wait_for`` and ``asyncio.timeout``,
which reach through anyio's non-abandoning thread wait; the API must apply
the same before/after-the-guard rule to them. pytest-asyncio runs in strict
mode here: it handles only tests marked ``asyncio``, the anyio plugin only
those marked ``anyio``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from anyio import wait_all_tasks_blocked
from miles_fsm.states import State
from test_aio import _build


@pytest.mark.asyncio
async def test_pytest_asyncio_drives_a_rollout_window():
    """Under pytest-asyncio, rollout() offloads, pauses and takes the GPU back as under anyio."""
    trainer, alc = _build()
    await alc.start()
    async with alc.rollout() as window:
        assert alc.state is State.PAUSED and window.epoch == 1
    assert alc.state is State.TRAINING
    assert "param_sync" in trainer.calls


@pytest.mark.asyncio
async def test_native_task_cancel_before_the_guard_abandons_cleanly():
    """task.cancel() while the transition plans abandons it: CancelledError, no step, state kept."""
    trainer, alc = _build()
    await alc.start()
    calls_before = list(trainer.calls)
    trainer.arm("plan")
    task = asyncio.create_task(alc.offload())
    await asyncio.to_thread(trainer.reached.wait)
    task.cancel()
    await wait_all_tasks_blocked()  # the task has seen its cancellation and waits for the thread
    trainer.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert alc.state is State.TRAINING and trainer.calls == calls_before


@pytest.mark.asyncio
async def test_native_task_cancel_after_the_point_of_no_return_waits_for_the_end():
    """task.cancel() during a step does not abandon the transition: the task ends only after it
    finished (state OFFLOADED), with CancelledError."""
    trainer, alc = _build()
    await alc.start()
    trainer.arm("backup:actor")
    task = asyncio.create_task(alc.offload())
    await asyncio.to_thread(trainer.reached.wait)
    task.cancel()
    await wait_all_tasks_blocked()
    assert not task.done() and alc.state is State.TRAINING
    task.cancel()  # a second native cancel is held back too
    await wait_all_tasks_blocked()
    assert not task.done()
    trainer.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert alc.state is State.OFFLOADED


@pytest.mark.asyncio
async def test_asyncio_wait_for_timeout_follows_the_guard_rule():
    """asyncio.wait_for timing out while planning abandons the transition; timing out during a step
    lets it finish first. Both raise TimeoutError."""
    trainer, alc = _build()
    await alc.start()
    trainer.arm("plan", hold_s=0.3)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(alc.offload(), 0.05)
    assert alc.state is State.TRAINING
    trainer.arm("backup:actor", hold_s=0.3)
    started = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(alc.offload(), 0.05)
    assert time.perf_counter() - started >= 0.3
    assert alc.state is State.OFFLOADED
