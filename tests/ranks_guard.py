"""Rank functions for the guard's own multi-process tests (importable by name)."""

from __future__ import annotations

from typing import Any

from miles_fsm.guard.consensus import Guard
from miles_fsm.launch.local import RankContext
from ranks_guard_scale import intent


def extra_guard_on_a_subgroup(ctx: RankContext) -> dict[str, Any]:
    """Ranks 0 and 1 build a guard over a subgroup rank 2 is not in; then every rank builds one over
    the default group, shares the run id through it and passes a guard with it."""
    import torch.distributed as dist

    sub = dist.new_group(ranks=[0, 1], backend="gloo")  # new_group is collective over every rank
    if ctx.rank in (0, 1):
        Guard.from_group(sub, timeout_s=5.0).close()
    guard = Guard.from_default_group(timeout_s=5.0)
    run = guard.share_run_id()
    guard.agree(intent(0), state="TRAINING")
    guard.close()
    return {"namespace": guard.namespace, "run": run}


def publisher_stops_at_close(ctx: RankContext) -> dict[str, Any]:
    """A lifecycle's guard runs its publisher thread until the lifecycle closes; closing twice is harmless."""
    import threading

    from ranks_engine import build

    def publishers() -> int:
        return sum(t.name == "miles-fsm-guard-publisher" for t in threading.enumerate())

    lc, _ = build(ctx)
    lc.start()
    before = publishers()
    lc.close()
    after = publishers()
    lc.close()
    lc.guard.close()
    return {"before": before, "after": after, "after_twice": publishers()}


class FailingStore:
    """The default store, whose ``set`` raises once ``failing`` is set, as a store whose host went away does."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.failing = False

    def set(self, key: str, value: Any) -> None:
        if self.failing:
            raise RuntimeError(f"injected store failure setting {key}")
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def store_set_fails(ctx: RankContext) -> dict[str, Any]:
    """Rank 1's store refuses writes after one healthy guard. Rank 1 then waits at two guards, so its
    publisher writes (and fails), and both pass; then rank 0 never comes to a third."""
    import time
    import warnings

    import torch.distributed as dist

    from miles_fsm.errors import GuardError
    from miles_fsm.guard import GuardStoreWarning

    raw = dist.distributed_c10d._get_default_store()
    store = FailingStore(raw)
    guard = Guard.from_default_group(timeout_s=2.0, store=store)
    guard.agree(intent(0), state="TRAINING")
    store.failing = ctx.rank == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in (1, 2):
            if ctx.rank == 0:
                time.sleep(0.5)  # rank 1 waits at the guard: its publisher writes its arrival
            guard.agree(intent(epoch), state="TRAINING")
    said = [w.message for w in caught if isinstance(w.message, GuardStoreWarning)]
    out: dict[str, Any] = {"warnings": [(w.rank, w.key, str(w.cause)) for w in said], "passed": 2}
    if ctx.rank == 0:
        while raw.add("test/reported", 0) < 1:  # away until rank 1 has its error, then gone quietly
            time.sleep(0.05)
        guard.close()
        return out
    try:
        guard.agree(intent(3), state="TRAINING")
    except GuardError as exc:
        out.update(error=type(exc).__name__, missing=list(getattr(exc, "missing", ())),
                   notes=list(getattr(exc, "__notes__", ())))  # fmt: skip
    raw.add("test/reported", 1)
    guard.close()
    return out
