"""Which run a directory's rank files belong to: never mix two runs' ranks in one diagnosis.

Every record carries ``run``, the same on every rank of one run. A
directory can still hold files of several runs: a 2-rank run written where
a 3-rank run was leaves the old ``rank-2.jsonl`` behind. Replay refuses to
read such a directory until ``--run`` picks one; the files of other runs
are then ignored and listed.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_fsm.ranks import rank_ranges
from miles_fsm.replay.model import RankTrace, TraceDirError

__all__ = ["MixedRunsError", "RunChoice", "choose_run"]

_SHOWN = 4


class MixedRunsError(TraceDirError):
    """The directory holds rank files of more than one run, and no ``--run`` picked one: bad input."""

    def __init__(self, path: str | os.PathLike[str], files: dict[str | None, list[str]], changing: list[str]) -> None:
        self.files = files
        self.changing = changing
        runs = "; ".join(f"run {_name(run)} in {_files(names)}" for run, names in files.items())
        midway = f"; {', '.join(changing)} {'changes' if len(changing) == 1 else 'change'} run midway" if changing \
            else ""  # fmt: skip
        named = [run for run in files if run is not None]
        commands = "; ".join(f"miles-fsm replay {shlex.quote(str(path))} --run {shlex.quote(run)}"
                             for run in named[:_SHOWN])
        more = f" (and {len(named) - _SHOWN} more)" if len(named) > _SHOWN else ""
        pick = f"replay one with: {commands}{more}" if named else "pick one with --run RUN_ID"
        super().__init__(path, f"holds traces of {len(files)} runs: {runs}{midway}; {pick}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunChoice:
    """The traces of the run read, the files left out as other runs', and what to warn about."""

    run: str | None
    traces: list[RankTrace]
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def choose_run(trace_dir: str | os.PathLike[str], traces: Sequence[RankTrace], run: str | None) -> RunChoice:
    """The traces of one run: the only one there, or ``run``. Raises ``MixedRunsError`` / ``TraceDirError``."""
    by_run: dict[str | None, list[str]] = {}
    for t in traces:
        for r in t.runs:
            by_run.setdefault(r, []).append(Path(t.path).name)
    changing = [Path(t.path).name for t in traces if len(t.runs) > 1]
    if run is None:
        if len(by_run) > 1:
            raise MixedRunsError(trace_dir, by_run, changing)
        only = next(iter(by_run), None)
        warnings = [] if only is not None or not traces else [
            "the records carry no run id (schema v1): every file is read as one run"]  # fmt: skip
        return RunChoice(run=only, traces=list(traces), warnings=warnings)
    if run not in by_run:
        here = ", ".join(_name(r) for r in by_run) or "none"
        raise TraceDirError(trace_dir, f"holds no record of run {run} (runs here: {here})")
    kept = [t for t in traces if run in t.runs]
    ignored = [t.path for t in traces if run not in t.runs]
    warnings = []
    for t in kept:
        others = {r: n for r, n in t.runs.items() if r != run}
        if others:
            warnings.append(f"{t.path} also holds {sum(others.values())} record(s) of run(s) "
                            f"{', '.join(_name(r) for r in others)}: ignored")  # fmt: skip
    return RunChoice(run=run, traces=kept, ignored=ignored, warnings=warnings)


def _name(run: str | None) -> str:
    return "(none: schema v1)" if run is None else run


def _files(names: list[str]) -> str:
    if len(names) <= _SHOWN:
        return ", ".join(sorted(names))
    ranks = sorted(int(n.split("-")[1].split(".")[0]) for n in names)
    return f"rank-<{rank_ranges(ranks)}>.jsonl ({len(names)} files)"
