"""Run a function on N local ranks over gloo, and always clean up.

The parent hosts the TCPStore, so the store outlives any rank that dies and
the survivors can still name it. Children start from a forkserver that has
torch imported already. Every exit path (return, timeout, Ctrl-C, an
exception in the parent) kills every child that is still alive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from miles_fsm.errors import MilesFsmError

__all__ = ["RankContext", "RankError", "RankOutcome", "run_ranks"]


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function receives."""

    rank: int
    world: int
    kwargs: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RankError:
    """An exception a rank raised, flattened so it crosses the process boundary."""

    type: str
    message: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """How one rank ended: its return value, its error, or neither (killed)."""

    rank: int
    exitcode: int | None
    result: Any = None
    error: RankError | None = None
    elapsed_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def _flatten(exc: BaseException) -> RankError:
    # A miles-fsm error's facts are its fields; other errors carry none.
    attrs = {k: v for k, v in exc.fields().items() if v is not None} if isinstance(exc, MilesFsmError) else {}
    return RankError(type(exc).__name__, str(exc), attrs, "".join(traceback.format_exception(exc)))


def _child(
    fn: Callable[[RankContext], Any],
    rank: int,
    world: int,
    port: int,
    kwargs: Mapping[str, Any],
    results: Any,
    pg_timeout_s: float,
) -> None:
    import torch.distributed as dist

    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
    )
    try:
        result = fn(RankContext(rank=rank, world=world, kwargs=kwargs))
    except BaseException as exc:  # reported to the parent, then the child exits non-zero
        results.put((rank, None, _flatten(exc), time.monotonic() - started))
        results.close()
        results.join_thread()
        os._exit(1)
    results.put((rank, result, None, time.monotonic() - started))
    results.close()
    results.join_thread()
    dist.destroy_process_group()


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "miles_fsm.launch"])
    return _CTX


def run_ranks(
    fn: Callable[[RankContext], Any],
    world: int,
    *,
    timeout_s: float,
    kwargs: Mapping[str, Any] | None = None,
    pg_timeout_s: float | None = None,
    on_result: Callable[[RankOutcome], None] | None = None,
    linger_s: float | None = None,
) -> list[RankOutcome]:
    """Run ``fn`` on ranks ``0..world-1`` and return one outcome per rank.

    ``fn`` must be importable by name (a module-level function). Ranks still
    alive after ``timeout_s`` are killed and reported with no result.
    ``pg_timeout_s`` is the default process group's timeout (default:
    ``timeout_s``). ``on_result`` sees each rank's outcome as it arrives.
    ``linger_s``: once a rank has failed, the others get this long to finish
    (and report their own errors) before they are killed; a rank hung in a
    collective would otherwise hold the run until ``timeout_s``.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world, store.port, dict(kwargs or {}), results, pg_timeout_s or timeout_s),
            name=f"miles-fsm-rank-{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                rank, result, error, elapsed = results.get(timeout=0.1)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # everyone is gone; drain what is left below
                continue
            procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
            outcomes[rank] = RankOutcome(rank, procs[rank].exitcode, result, error, elapsed)
            if on_result is not None:
                on_result(outcomes[rank])
            if linger_s is not None and not outcomes[rank].ok:
                deadline = min(deadline, time.monotonic() + linger_s)
        _drain(results, procs, outcomes, on_result)
    finally:
        _kill(procs)
        results.close()
        results.cancel_join_thread()
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, p.exitcode)
            if on_result is not None:
                on_result(outcomes[r])
    return [outcomes[r] for r in range(world)]


def _drain(results: Any, procs: list[Any], outcomes: dict[int, RankOutcome], on_result: Any) -> None:
    while True:
        try:
            rank, result, error, elapsed = results.get(timeout=0.05)
        except queue.Empty:
            return
        procs[rank].join(timeout=1.0)
        outcomes[rank] = RankOutcome(rank, procs[rank].exitcode, result, error, elapsed)
        if on_result is not None:
            on_result(outcomes[rank])


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 2.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5.0)
