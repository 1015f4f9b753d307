"""``run_demo``: start the ranks, follow their progress, and gather how the run ended."""

from __future__ import annotations

import time
from typing import Any

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.apps.demo.progress import Progress
from miles_fsm.apps.demo.rank import rank_main
from miles_fsm.apps.demo.report import DemoResult, blame, count_events
from miles_fsm.launch import run_ranks
from miles_fsm.tracing import trace_path

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
    verified = {r: count_events(trace_path(config.trace_dir, r), "verified") for r in range(config.ranks)}
    culprits, diagnosis = blame(outcomes, config)
    return DemoResult(
        config=config, outcomes=tuple(outcomes), wall_s=wall, verified=verified, culprits=culprits, diagnosis=diagnosis
    )
