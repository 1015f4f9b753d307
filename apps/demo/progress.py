"""Live progress of a demo run, read from the ranks' traces while they run.

On a terminal, a rich progress bar; otherwise one line per step verified on
every rank, and one per rank failure, as they happen.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.tracing import trace_path

__all__ = ["Progress"]


class Progress:
    """Follows the ranks' traces from a thread and reports finished steps."""

    def __init__(self, config: DemoConfig, out: Any) -> None:
        self._config = config
        self._out = out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-fsm-demo-progress", daemon=True)
        self._offsets = [0] * config.ranks
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
        for r in range(self._config.ranks):
            path = trace_path(self._config.trace_dir, r)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[r])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self._offsets[r] += end
            for line in chunk[:end].splitlines():
                rec = orjson.loads(line)
                if rec.get("event") == "demo_step":
                    self._done[r] += 1
                elif rec.get("event") in ("transition_failed", "demo_failed"):
                    note = f"rank {r} failed: {rec.get('error')}"
                    if not self._out.is_terminal:
                        self._out.print(f"rank {r}: {rec.get('event')} ({rec.get('error')})", markup=False)
                elif rec.get("event") == "transition_started":
                    note = f"rank {r}: {rec.get('trigger')} (epoch {rec.get('epoch')})"
        return note
