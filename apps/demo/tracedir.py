"""The demo's trace directory: usable, and holding this run's traces only.

A directory that already holds rank traces (an earlier demo, a run with more
ranks) would mix two runs: replay would read a rank file this run never
wrote, and the tracer's own rotation (``rank-<r>.jsonl.<n>``) only covers the
ranks this run has. So before the ranks start, every ``rank-<r>.jsonl`` and
rotated ``rank-<r>.jsonl.<n>`` file (and the index beside it), and every
Flight Recorder dump ``fr-rank-<r>.json`` (and its torch-format twin
``nccl_trace_rank_<r>``) of that run, is moved into
``earlier-runs/<timestamp>/`` inside the directory; nothing is deleted, and
replay, which reads only the top level, sees this run alone. One demo at a
time per directory: a second one started while the first runs moves the
first's files away.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import orjson

from miles_fsm.apps.demo.config import fresh_trace_dir
from miles_fsm.apps.errors import TraceDirUnusableError

__all__ = ["EARLIER_RUNS", "prepare_trace_dir", "trace_run"]

#: The folder inside a trace directory that earlier runs' rank files are moved to.
EARLIER_RUNS = "earlier-runs"
_RANK_FILE = re.compile(r"^(rank-\d+\.jsonl(\.\d+)?(\.index)?|fr-rank-\d+\.json|nccl_trace_rank_\d+)$")


def prepare_trace_dir(path: Path) -> Path | None:
    """Make ``path`` a writable directory holding no rank traces; where earlier ones went, if any.

    Raises ``TraceDirUnusableError`` when it cannot be created, written or
    cleared: before any rank starts, so no process is left to clean up.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Permission bits do not bind root, and a read-only mount shows only on a write: try one.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".miles-fsm-probe-"):
            pass
        stale = sorted(n for n in os.listdir(path) if _RANK_FILE.match(n))
        if not stale:
            return None
        target = fresh_trace_dir(path / EARLIER_RUNS)
        target.mkdir(parents=True)
        for name in stale:
            (path / name).rename(target / name)
    except OSError as exc:
        raise TraceDirUnusableError(path=str(path), reason=exc.strerror or str(exc)) from exc
    return target


def trace_run(path: Path) -> str | None:
    """The run id in a trace file's first record; None when there is no complete first record."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    if not first.endswith(b"\n"):
        return None  # cut off while being written: not a record yet
    try:
        rec = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    return rec.get("run") if isinstance(rec, dict) else None
