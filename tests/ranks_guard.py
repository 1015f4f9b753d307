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
