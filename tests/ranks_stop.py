"""Rank functions for tests of how the local launcher stops ranks (importable by name)."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from miles_fsm.errors import plain
from miles_fsm.launch.local import RankContext


def _record_stop(ctx: RankContext) -> None:
    out = Path(ctx.kwargs["out"])

    def record(error: BaseException) -> None:
        (out / f"stopped-{ctx.rank}.json").write_bytes(
            orjson.dumps({"type": type(error).__name__, "message": str(error), **plain(error.fields())})
        )

    ctx.on_stopped(record)


def zero_fails_one_waits_in_a_collective(ctx: RankContext) -> None:
    """Rank 0 raises; rank 1 blocks in an all-reduce of a group with rank 2, which sleeps instead.

    The group leaves rank 0 out, so rank 0's exit does not break rank 1's wait: only a stop ends it.
    """
    _record_stop(ctx)
    pair = dist.new_group([1, 2], backend="gloo")  # collective: every rank makes it
    if ctx.rank == 0:
        raise ValueError("rank 0's own failure")
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1), group=pair)
    time.sleep(600)


def every_rank_sleeps(ctx: RankContext) -> None:
    _record_stop(ctx)
    time.sleep(600)
