"""Rank functions for the tests of live errors (importable by name, as the launchers need)."""

from __future__ import annotations

import threading
import time
from typing import Any

from miles_fsm.errors import MilesFsmError
from miles_fsm.launch.local import RankContext


class Unpicklable(RuntimeError):
    """An exception that holds a lock, so it does not pickle (as many real exceptions' do not)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class LockedFactError(MilesFsmError, RuntimeError):
    """A miles-fsm-style error one of whose facts does not pickle."""

    def __init__(self, *, lock: Any) -> None:
        self.lock = lock
        super().__init__("a fact of this error holds a lock")


def one_raises_unpicklable(ctx: RankContext) -> dict[str, Any]:
    """``kwargs["bad"]`` raises an unpicklable exception (``kind``: plain or a miles-fsm fact); the others
    return after ``kwargs["after_s"]``."""
    if ctx.rank == ctx.kwargs["bad"]:
        if ctx.kwargs.get("kind") == "fact":
            raise LockedFactError(lock=threading.Lock())
        raise Unpicklable(f"rank {ctx.rank}'s engine socket broke")
    time.sleep(ctx.kwargs.get("after_s", 0.0))
    return {"rank": ctx.rank, "fine": True}


def one_step_raises(ctx: RankContext) -> dict[str, Any]:
    """Cycles where rank ``kwargs["bad"]``'s rematerialize cast raises; it then exits at once, or waits
    ``kwargs["stay_s"]`` first (its peers then time out at their guard instead of losing it). Rank
    ``kwargs.get("hang")`` hangs before its sync guard."""
    import ranks_engine
    from miles_fsm import Trigger

    lc, trainer = ranks_engine.build(ctx)
    lc.start()
    if ctx.rank == ctx.kwargs["bad"]:
        trainer.fail_on = "cast_main_to_params"
    hang = ctx.kwargs.get("hang") == ctx.rank

    def stall() -> None:
        if hang:
            time.sleep(3600)

    try:
        for t in lc.cycle:
            lc.fire(t, before_guard=stall if t is Trigger.SYNC else None)
    except RuntimeError:
        if ctx.rank == ctx.kwargs["bad"]:
            time.sleep(ctx.kwargs.get("stay_s", 0.0))
        raise
    return {"state": lc.state.value}


def one_never_builds(ctx: RankContext) -> dict[str, Any]:
    """Rank ``kwargs["bad"]``'s driver raises before it builds its Lifecycle; the others build theirs."""
    import ranks_engine

    if ctx.rank == ctx.kwargs["bad"]:
        raise ValueError("the driver's __init__ failed")
    lc, _ = ranks_engine.build(ctx)
    lc.start()
    return {"state": lc.state.value}
