"""Where the colocated loop's traces go, and the commands that replay them.

Each lifecycle of the loop (one per strategy and push format) is a run of
its own, with its own ``rank-0.jsonl``: it gets a folder of its own under
the trace root, named for the lifecycle (``rematerialize_tensors``,
``backup_flattened_bucket``, ...). ``miles-fsm replay ROOT/<name>`` replays
one of them.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_fsm.trace.writer import trace_path

__all__ = ["lifecycle_label", "lifecycle_trace_dir", "replay_lines"]


def lifecycle_label(strategy: Any, load_format: str | None) -> str:
    """``<strategy>/<push format>``: how the loop names a lifecycle in its output and JSON."""
    return f"{strategy.value}/{load_format or 'tensors'}"


def lifecycle_trace_dir(root: Path, strategy: Any, load_format: str | None) -> Path:
    """The folder of one lifecycle's traces under ``root``."""
    return root / lifecycle_label(strategy, load_format).replace("/", "_")


def replay_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One ``miles-fsm replay <folder>`` per lifecycle that left a trace, runnable as printed (quoted for a shell)."""
    folders = [Path(run["traces"]) for run in runs if isinstance(run.get("traces"), str)]
    return [f"miles-fsm replay {shlex.quote(str(f))}" for f in folders if trace_path(f, 0).exists()]
