"""A folder of runs: ``miles-fsm replay D`` where ``D`` holds one sub-folder of rank traces per run.

The colocated loop writes one sub-folder per lifecycle under its
``--trace-dir``; a user keeps one per job. ``D`` itself then holds no
``rank-<r>.jsonl``, and replay looks one level down, never further: each
sub-folder (a real directory, not a link to one) that holds a rank file is
a run. One run is replayed as if it had been named; several are replayed one
by one, each with its verdict and the exact command that replays it in
full, and ``--run NAME`` picks one by its sub-folder's name or its run id.
At most ``MAX_LISTED`` runs are replayed and listed, and at most
``MAX_SCANNED`` entries of ``D`` looked at: a huge folder costs a bounded
time, and the report says what was left out.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from miles_fsm.replay.files import trace_rank
from miles_fsm.replay.model import TraceDirError

__all__ = ["MAX_LISTED", "MAX_SCANNED", "RunFolders", "command", "run_folders"]

#: Runs replayed and listed at most; more are counted, and named by the command that lists them all.
MAX_LISTED = 32
#: Entries of the folder looked at, at most.
MAX_SCANNED = 4096
#: Bytes read from a run's first rank file to learn its run id (one record is far smaller).
_FIRST_RECORD = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFolders:
    """What ``DIR`` is to replay: one run's folder (``path``), or several (``each``) to replay one by one."""

    #: The folder named on the command line.
    folder: Path
    #: The folder of rank files to replay (None: several runs, ``each``).
    path: Path | None
    #: The run id to read in ``path`` (``--run``, passed on), None for all.
    run: str | None = None
    #: Sub-folders that are runs, when no one was picked (sorted by name, at most ``MAX_LISTED``).
    each: list[Path] = field(default_factory=list)
    #: Runs found beyond ``MAX_LISTED``, and whether the scan stopped at ``MAX_SCANNED`` entries.
    more: int = 0
    scan_cut: bool = False
    #: Why ``path`` is not the folder named (a one-line note for stderr), or None.
    note: str | None = None


def command(sub: Path) -> str:
    """The exact command that replays one run of a folder of runs in full."""
    return f"miles-fsm replay {shlex.quote(str(sub))}"


def run_folders(folder: str | os.PathLike[str], run: str | None = None) -> RunFolders:
    """How to replay ``folder``: itself (it holds rank files, or nothing this reads), one sub-folder, or each.

    ``run`` (``--run``) names a sub-folder or the run id its traces carry, when ``folder`` is a folder of
    runs; otherwise it is passed on as the run id to read. Raises ``TraceDirError`` when ``run`` names
    none of the runs found.
    """
    root = Path(folder)
    itself = RunFolders(folder=root, path=root, run=run)
    names = _names(root)
    if names is None or any(trace_rank(n) is not None for n in names[0]):
        return itself  # not a folder, or one run's own: replay reads (or refuses) it as before
    listed, scan_cut = names
    runs = sorted((root / n for n in listed if _holds_rank_files(root / n)), key=lambda p: p.name)
    if not runs:
        return itself  # replay says it holds no rank-<r>.jsonl, as before
    if run is not None:
        path, run_id = _picked(root, runs, run)
        return RunFolders(folder=root, path=path, run=run_id, note=f"replayed {path}, one of the {_runs(runs)}")
    if len(runs) == 1:
        note = f"{root} holds no rank-<r>.jsonl of its own: replayed its one run, {runs[0]}"
        return RunFolders(folder=root, path=runs[0], note=note)
    return RunFolders(
        folder=root, path=None, each=runs[:MAX_LISTED], more=max(0, len(runs) - MAX_LISTED), scan_cut=scan_cut
    )


def _names(root: Path) -> tuple[list[str], bool] | None:
    """At most ``MAX_SCANNED`` names in ``root``, and whether there were more (None: not a readable folder)."""
    if not root.is_dir():
        return None
    names: list[str] = []
    try:
        with os.scandir(root) as it:
            for entry in it:
                if len(names) == MAX_SCANNED:
                    return names, True
                names.append(entry.name)
    except OSError:
        return None  # replay itself says why it cannot list it
    return names, False


def _holds_rank_files(sub: Path) -> bool:
    """A real sub-folder (links to folders are not followed) with a rank file in its first entries."""
    if sub.is_symlink() or not sub.is_dir():
        return False
    try:
        with os.scandir(sub) as it:
            for k, entry in enumerate(it):
                if trace_rank(entry.name) is not None:
                    return True
                if k >= MAX_SCANNED:
                    return False
    except OSError:
        return False
    return False


def _picked(root: Path, runs: list[Path], run: str) -> tuple[Path, str | None]:
    """The run ``--run`` names: a sub-folder's name (all of it read), else the run id its first record
    carries (that run read)."""
    for sub in runs:
        if sub.name == run:
            return sub, None
    for sub in runs[:MAX_LISTED]:
        if _run_id(sub) == run:
            return sub, run
    shown = ", ".join(p.name for p in runs[:8]) + (f" and {len(runs) - 8} more" if len(runs) > 8 else "")
    raise TraceDirError(
        root,
        f"holds no run named {run} (its runs, one sub-folder each: {shown}); "
        "give a sub-folder's name or a run id to --run",
    )


def _run_id(sub: Path) -> str | None:
    """The ``run`` of the first record of the lowest rank's file (a bounded read; None: none readable)."""
    try:
        ranks = sorted(r for n in os.listdir(sub) if (r := trace_rank(n)) is not None)
        path = sub / f"rank-{ranks[0]}.jsonl"
        if not path.is_file():  # a FIFO or a device is never opened
            return None
        with open(path, "rb") as f:
            line = f.read(_FIRST_RECORD).split(b"\n", 1)[0]
        rec = orjson.loads(line)
    except (OSError, IndexError, orjson.JSONDecodeError):
        return None
    value = rec.get("run") if isinstance(rec, dict) else None
    return value if isinstance(value, str) else None


def _runs(runs: list[Path]) -> str:
    return f"{len(runs)} run(s) in {runs[0].parent}"
