"""Rank functions for the guard's failure path at scale (importable by name)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from miles_fsm.guard import consensus as guard_module
from miles_fsm.errors import GuardError
from miles_fsm.guard.consensus import Guard
from miles_fsm.launch.local import RankContext
from miles_fsm.plan import Intent, TensorSet

#: The store calls that read (or wait on) other ranks' keys, as opposed to this rank's own writes.
READS = ("get", "multi_get", "check", "wait", "add")


class CountingStore:
    """A store that counts the calls made through it; ``claimed`` makes every rank a non-reporter."""

    def __init__(self, store: Any, *, claimed: bool = False) -> None:
        self._store = store
        self._claimed = claimed
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if name == "add" and self._claimed and str(args[0]).endswith("/claim"):
                return 2  # as if a reporter had claimed the failure, then died
            return method(*args, **kwargs)

        return counted


def intent(epoch: int, trigger: str = "sync") -> Intent:
    tensors = TensorSet.of([("w", torch.zeros(4)), ("b", torch.zeros(2))])
    return Intent(epoch=epoch, trigger=trigger, source="TRAINING", dest="SYNCING", strategy="plain",
                  collectives=(), tensors=tensors)


def one_rank_hangs(ctx: RankContext) -> dict[str, Any]:
    """Pass one guard together; then ``hang_rank`` never comes to the second, and the others report it."""
    import torch.distributed as dist

    if ctx.kwargs.get("report_wait_s") is not None:
        guard_module._REPORT_WAIT_S = ctx.kwargs["report_wait_s"]
    raw = dist.distributed_c10d._get_default_store()
    store = CountingStore(raw, claimed=ctx.kwargs.get("claimed", False))
    guard = Guard.from_default_group(timeout_s=ctx.kwargs.get("timeout_s", 1.0), store=store)
    guard.agree(intent(0), state="TRAINING")
    if ctx.rank == ctx.kwargs["hang_rank"]:
        # Away from the guard until every other rank has its error, then gone quietly.
        while raw.add("test/reported", 0) < ctx.world - 1:
            time.sleep(0.05)
        return {"error": None}
    before = Counter(store.calls)
    try:
        guard.agree(intent(1), state="TRAINING")
    except GuardError as exc:  # the test asserts on what every rank raised
        reads = {k: store.calls[k] - before[k] for k in READS}
        result = {"error": type(exc).__name__, "missing": list(exc.missing), "reads": reads,
                  "last_seen": {r: (s.epoch, s.trigger, s.phase) for r, s in exc.last_seen.items() if s}}
    else:
        result = {"error": None}
    raw.add("test/reported", 1)
    return result
