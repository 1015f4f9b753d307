"""``miles-fsm replay D`` on a folder of runs (``miles_fsm.replay.folders``): each run's verdict, and the folder's.

Each run is replayed on its own, as ``miles-fsm replay D/<run>`` would; the
report gives its verdict line (and culprit), and the exact command that
replays it in full. The exit code is the worst: 3 when any run has a
problem, else 2 when any run could not be read, else 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from miles_fsm.flight_recorder import FlightRecorderError
from miles_fsm.replay.diagnose import Diagnosis
from miles_fsm.replay.folders import MAX_LISTED, MAX_SCANNED, RunFolders, command, run_folders
from miles_fsm.replay.model import EpochRange, TraceDirError
from miles_fsm.replay.report import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEM, replay, report_lines

__all__ = ["RunResult", "Several", "replay_folder"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One run of the folder: its diagnosis, or why it could not be read."""

    path: Path
    diagnosis: Diagnosis | None
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_BAD_INPUT if self.diagnosis is None else self.diagnosis.exit_code

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.path.name,
            "path": str(self.path),
            "command": command(self.path),
            "exit_code": self.exit_code,
            "error": self.error,
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_json(),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Several:
    """Every run of a folder of runs, replayed one by one."""

    found: RunFolders
    runs: list[RunResult]

    @property
    def exit_code(self) -> int:
        """The worst: a problem diagnosed in any run (3), else a run not read (2), else healthy (0)."""
        codes = {r.exit_code for r in self.runs}
        return EXIT_PROBLEM if EXIT_PROBLEM in codes else EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        """``{"folder", "runs": [{folder, path, command, exit_code, error, diagnosis}], "more", "exit_code"}``."""
        return {
            "folder": str(self.found.folder),
            "runs": [r.to_json() for r in self.runs],
            "more": self.found.more,
            "scan_cut": self.found.scan_cut,
            "exit_code": self.exit_code,
        }

    def render(self, out: TextIO) -> None:
        out.write("\n".join(self.lines()) + "\n")

    def lines(self) -> list[str]:
        """The report: one entry per run (its verdict, culprit and notes, the command), then what was left out."""
        healthy = sum(1 for r in self.runs if r.exit_code == EXIT_OK)
        lines = [
            f"{len(self.runs)} runs in {self.found.folder} (one sub-folder each), replayed one by one: "
            f"{healthy} healthy, {len(self.runs) - healthy} not"
        ]
        for r in self.runs:
            lines.append(f"  {r.path.name}:")
            if r.diagnosis is None:
                lines.append(f"    could not be read: {r.error}")
            else:
                lines.extend(f"    {text.strip()}" for text in _verdict_lines(r.diagnosis))
            lines.append(f"    in full: {command(r.path)}")
        if self.found.more:
            lines.append(
                f"  ... and {self.found.more} more run(s), not replayed (at most {MAX_LISTED}): "
                f"replay one with {command(self.found.folder / '<sub-folder>')}"
            )
        if self.found.scan_cut:
            lines.append(f"  (only the first {MAX_SCANNED} entries of {self.found.folder} were looked at)")
        return lines


def _verdict_lines(d: Diagnosis) -> list[str]:
    """The report's lines before its first section: the verdict, the culprit, the notes."""
    head = []
    for _, text in report_lines(d):
        if text.startswith("\n"):
            break
        head.append(text.replace("(below)", "(in the full report)"))
    return head


def replay_folder(
    trace_dir: str,
    *,
    ranks: Iterable[int] | None = None,
    epochs: EpochRange | None = None,
    workers: int | None = None,
    straggler_ratio: float = 1.5,
    perfetto: str | None = None,
    run: str | None = None,
    flight_recorder: str | None = None,
    fr_prefix: str | None = None,
) -> Diagnosis | Several:
    """``replay`` of ``trace_dir``, or of its runs when it is a folder of runs (one sub-folder each).

    Raises what ``replay`` raises; ``TraceDirError`` too when ``--run`` names none of the folder's runs,
    or when a flag that writes or reads one run's files (``--perfetto``, ``--flight-recorder``) meets several.
    """
    found = run_folders(trace_dir, run)
    kw: dict[str, Any] = {
        "ranks": ranks,
        "epochs": epochs,
        "workers": workers,
        "straggler_ratio": straggler_ratio,
        "fr_prefix": fr_prefix,
    }
    if found.path is not None:
        d = replay(str(found.path), perfetto=perfetto, run=found.run, flight_recorder=flight_recorder, **kw)
        return d if found.note is None else dataclasses.replace(d, notes=[*d.notes, found.note])
    for flag, value in (("--perfetto", perfetto), ("--flight-recorder", flight_recorder)):
        if value is not None:
            raise TraceDirError(
                trace_dir,
                f"holds {len(found.each) + found.more} runs (one sub-folder each), and "
                f"{flag} is for one: pick it with --run NAME, or name its sub-folder",
            )
    return Several(found=found, runs=[_one(sub, kw) for sub in found.each])


def _one(sub: Path, kw: dict[str, Any]) -> RunResult:
    try:
        return RunResult(path=sub, diagnosis=replay(str(sub), **kw))
    except (TraceDirError, FlightRecorderError) as exc:
        return RunResult(path=sub, diagnosis=None, error=str(exc))
