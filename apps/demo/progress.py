"""Live progress of a demo run, read from the ranks' traces while they run.

On a terminal, a rich progress bar; otherwise one line per step verified on
every rank, and one per rank failure, as they happen. The traces are tailed,
not re-read: each poll parses only the lines completed since the last one,
and only records of this run (their ``run`` field) count.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.apps.demo.events import DEMO_FAILED, DEMO_STEP
from miles_fsm.trace.schema import TRANSITION_FAILED, TRANSITION_STARTED
from miles_fsm.trace.writer import trace_path

__all__ = ["Progress"]

_FAILED = (TRANSITION_FAILED, DEMO_FAILED)


class _Tail:
    """The records of run ``run`` appended to one rank's trace since the last read.

    Records of other runs (an earlier run's file that is still there, another
    run writing into the same directory) are skipped by their ``run`` field.
    When the file at ``path`` is replaced (rotated, moved aside) the new one
    is read from its start.
    """

    def __init__(self, path: Path, run: str) -> None:
        self._path = path
        self._run = run
        self._inode: int | None = None
        self._offset = 0

    def records(self) -> list[dict[str, Any]]:
        try:
            with open(self._path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset = st.st_ino, 0
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:  # the rank has not opened its trace yet
            return []
        # A line without its newline is still being written, or was cut short by a kill: never parsed.
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in chunk[:end].splitlines():
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a damaged line only loses a progress tick; the report's reader lists it
            if isinstance(rec, dict) and rec.get("run") == self._run:
                out.append(rec)
        return out


class Progress:
    """Follows the ranks' traces from a thread and reports finished steps."""

    def __init__(self, config: DemoConfig, out: Any, *, run: str) -> None:
        self._config = config
        self._out = out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-fsm-demo-progress", daemon=True)
        self._tails = [_Tail(trace_path(config.trace_dir, r), run) for r in range(config.ranks)]
        self._done = [0] * config.ranks
        self._reported = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        if not self._out.is_terminal:
            self._poll()
            self._report_plain()

    def _run(self) -> None:
        c = self._config
        if self._out.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[bold]demo[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.description}"), console=self._out, transient=True,
            ) as bar:
                task = bar.add_task("starting ranks", total=c.ranks * c.steps)
                while not self._stop.wait(0.1):
                    note = self._poll()
                    bar.update(task, completed=sum(self._done), description=note or "")
            return
        while not self._stop.wait(0.25):
            self._poll()
            self._report_plain()

    def _report_plain(self) -> None:
        c = self._config
        while self._reported < min(self._done):
            self._reported += 1
            self._out.print(f"step {self._reported}/{c.steps}: verified bit-exact on all {c.ranks} ranks")

    def _poll(self) -> str:
        note = ""
        for r, tail in enumerate(self._tails):
            for rec in tail.records():
                event = rec.get("event")
                if event == DEMO_STEP:
                    self._done[r] += 1
                elif event in _FAILED:
                    note = f"rank {r} failed: {rec.get('error')}"
                    if not self._out.is_terminal:
                        self._out.print(f"rank {r}: {event} ({rec.get('error')})", markup=False)
                elif event == TRANSITION_STARTED:
                    note = f"rank {r}: {rec.get('trigger')} (epoch {rec.get('epoch')})"
        return note
