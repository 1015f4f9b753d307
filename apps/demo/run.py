"""``run_demo``: start the ranks, follow their progress, and gather how the run ended."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.apps.demo.progress import Progress
from miles_fsm.apps.demo.rank import rank_main
from miles_fsm.apps.demo.report import DemoResult, blame
from miles_fsm.diagnosis import diagnose
from miles_fsm.launch import run_ranks
from miles_fsm.trace_files import find_traces
from miles_fsm.trace_model import RankTrace, TraceDirError
from miles_fsm.trace_reader import read_ranks

__all__ = ["run_demo"]


def run_demo(config: DemoConfig, *, out: Any = None) -> DemoResult:
    """Run the demo and print progress to ``out`` (a rich Console; None: quiet)."""
    problems = config.problems()
    if problems:
        from miles_fsm.errors import ConfigError

        raise ConfigError(problems, "demo")
    config.trace_dir.mkdir(parents=True, exist_ok=True)
    watcher = Progress(config, out) if out is not None else None
    started = time.monotonic()
    if watcher is not None:
        watcher.start()
    try:
        outcomes = run_ranks(
            rank_main,
            config.ranks,
            timeout_s=config.run_timeout_s,
            kwargs=config.to_kwargs(),
            pg_timeout_s=config.pg_timeout_s,
            linger_s=config.linger_s,
        )
    finally:
        if watcher is not None:
            watcher.stop()
    wall = time.monotonic() - started
    traces = _read_traces(config.trace_dir, config.ranks)
    failed = not all(o.ok for o in outcomes)
    replay = diagnose(list(traces.values()), expected=range(config.ranks)) if failed and traces else None
    culprits, diagnosis = blame(outcomes, traces, replay)
    return DemoResult(
        config=config,
        outcomes=tuple(outcomes),
        wall_s=wall,
        verified={r: traces[r].verified if r in traces else 0 for r in range(config.ranks)},
        culprits=culprits,
        diagnosis=diagnosis,
    )


def _read_traces(trace_dir: Path, ranks: int) -> dict[int, RankTrace]:
    """This run's traces, folded by the replay reader; files of ranks outside the run are older runs'."""
    try:
        files = find_traces(trace_dir)
    except TraceDirError:
        # run_demo made the directory, so no rank wrote a trace: every rank's report says so.
        return {}
    return {t.rank: t for t in read_ranks({r: p for r, p in files.items() if r < ranks})}
