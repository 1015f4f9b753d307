"""Run a rank function under torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``).

torchrun's agent hosts the store and restarts or tears down workers; this
joins its process group over gloo and runs the function in this process.
A worker that raises writes its error, fields included, to
``<out_dir>/rank-<r>.error.json`` (and re-raises, so the agent sees the
failure), so whoever started torchrun can read which rank failed and why;
it also writes torch elastic's error file, and a rank that a peer's error
names writes its own when the agent stops it (``elastic``), so that
torchrun's own summary names the rank that failed first.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.errors import ProcessGroupMissingError, describe, plain
from miles_fsm.launch.elastic import publish_named, record_error, watch_agent_stop
from miles_fsm.launch.local import RankContext
from miles_fsm.launch.stopping import block_stop_signals

__all__ = ["run_under_torchrun"]


def run_under_torchrun(
    fn: Callable[[RankContext], Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
    out_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Join torchrun's process group (gloo), run ``fn`` as this worker's rank, leave the group.

    ``out_dir``: where each worker writes ``rank-<r>.result.json`` or
    ``rank-<r>.error.json``.
    """
    import torch.distributed as dist

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise ProcessGroupMissingError(world_size=int(os.environ.get("WORLD_SIZE") or 0),
                                       rank=os.environ.get("RANK")) from exc  # fmt: skip
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # Before the process group's threads start: they inherit it. The agent's SIGTERM then reaches
        # watch_agent_stop, wherever the main thread is blocked. An application's own handler is left alone.
        block_stop_signals()
        threading.Thread(target=watch_agent_stop, args=(rank, threading.get_ident()), name="miles-fsm-agent-stop",
                         daemon=True).start()  # fmt: skip
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    out = Path(out_dir) if out_dir is not None else None
    try:
        result = fn(RankContext(rank=rank, world=world, kwargs=dict(kwargs or {})))
    except BaseException as exc:
        if out is not None:
            _write(out / f"rank-{rank}.error.json", describe(exc))
        record_error(exc)  # for torchrun's summary
        publish_named(exc, rank=rank)
        raise
    else:
        if out is not None:
            _write(out / f"rank-{rank}.result.json", plain(result))
        return result
    finally:
        dist.destroy_process_group()


def _write(path: Path, record: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(record, default=str))
    tmp.replace(path)  # whole or not at all: a reader never sees half a record
