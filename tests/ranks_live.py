"""Rank functions for the tests of live errors (importable by name, as the launchers need)."""

from __future__ import annotations

import threading
import time
from typing import Any

from miles_fsm.errors import MilesFsmError
from miles_fsm.launch import RankContext


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
