"""Rank functions for the replay verdict tests: real lifecycles doing what a user's loop does (importable by
name, as the launchers need)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import orjson
from toy import ToyEngine, ToyTrainer

from miles_fsm.config import GuardConfig, LifecycleConfig
from miles_fsm.launch.local import RankContext
from miles_fsm.states.lifecycle import Lifecycle


def _lifecycle(ctx: RankContext) -> Lifecycle:
    guard = GuardConfig(timeout_s=ctx.kwargs.get("guard_timeout_s", 10.0))
    return Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(),
                     config=LifecycleConfig(guard=guard, trace_dir=ctx.kwargs["trace_dir"]))


def _cycle(lc: Lifecycle) -> None:
    for fire in (lc.offload, lc.pause, lc.rematerialize, lc.sync, lc.resume):
        fire()


def one_raises_in_its_loop(ctx: RankContext) -> dict[str, Any]:
    """Every rank runs a cycle; then rank ``kwargs["bad"]``'s own loop raises ValueError (outside any
    transition), which leaves its ``with`` block; the others go on to the next offload and its guard."""
    try:
        with _lifecycle(ctx) as lc:
            lc.start()
            _cycle(lc)
            if ctx.rank == ctx.kwargs["bad"]:
                raise ValueError("bad batch: 3 rows have no tokens")
            _cycle(lc)
    except ValueError as exc:  # the test reads the trace; the rank itself reports it here
        return {"error": str(exc)}
    except Exception as exc:  # the survivors' guard error: what the test expects them to see
        return {"error": type(exc).__name__}
    return {"error": None}


def snapshot_while_peers_wait(ctx: RankContext) -> dict[str, Any]:
    """Every rank runs a cycle; then rank ``kwargs["slow"]``, in its own train step, waits until every other
    rank is at offload's guard and copies the trace folder as it stands (``kwargs["snapshot"]``): a live,
    healthy run caught mid-way. Then it goes on, and every rank runs another cycle."""
    with _lifecycle(ctx) as lc:
        lc.start()
        _cycle(lc)
        if ctx.rank == ctx.kwargs["slow"]:
            _copy_when_waiting(Path(ctx.kwargs["trace_dir"]), Path(ctx.kwargs["snapshot"]), ctx.rank, ctx.world)
        _cycle(lc)
    return {"error": None}


def _copy_when_waiting(traces: Path, snapshot: Path, me: int, world: int, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    others = [traces / f"rank-{r}.jsonl" for r in range(world) if r != me]
    while not all(_at_guard(p) for p in others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks never reached offload's guard within {within_s} s")
        time.sleep(0.05)
    snapshot.mkdir(parents=True)
    for r in range(world):
        shutil.copyfile(traces / f"rank-{r}.jsonl", snapshot / f"rank-{r}.jsonl")


def _at_guard(path: Path) -> bool:
    if not path.exists():
        return False
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        if rec.get("event") == "guard_entered" and rec.get("trigger") == "offload" and rec.get("epoch") == 2:
            return True
    return False
