"""Where a rank's trace and its index lie: the one naming rule the writer and the reader share."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["INDEX_SUFFIX", "index_path", "trace_path"]

INDEX_SUFFIX = ".index"


def trace_path(trace_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its trace."""
    return Path(trace_dir) / f"rank-{rank}.jsonl"


def index_path(trace: str | os.PathLike[str]) -> Path:
    """Where the index of ``trace`` lies: beside it, ``<name>.index``."""
    trace = Path(trace)
    return trace.with_name(trace.name + INDEX_SUFFIX)
