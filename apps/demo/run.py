"""``run_demo``: start the ranks, follow their progress, and gather how the run ended."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.apps.demo.megatron_rank import megatron_rank_main
from miles_fsm.apps.demo.progress import Progress
from miles_fsm.apps.demo.rank import rank_main
from miles_fsm.apps.demo.report import DemoResult, blame
from miles_fsm.apps.demo.tracedir import prepare_trace_dir, trace_run
from miles_fsm.flight_recorder import DEFAULT_BUFFER, FR_ENV
from miles_fsm.launch.local import run_ranks
from miles_fsm.replay.diagnose import diagnose
from miles_fsm.replay.model import RankTrace
from miles_fsm.replay.read import read_ranks
from miles_fsm.trace.writer import new_run_id, trace_path

__all__ = ["result_of", "run_demo"]


def run_demo(config: DemoConfig, *, out: Any = None) -> DemoResult:
    """Run the demo and print progress to ``out`` (a rich Console; None: quiet).

    Raises ``ConfigError`` for a bad config and ``TraceDirUnusableError`` for
    a trace directory it cannot use, both before any rank starts. Rank
    traces of earlier runs in the directory are moved aside first
    (``tracedir``).
    """
    problems = config.problems()
    if problems:
        from miles_fsm.errors import ConfigError

        raise ConfigError(problems, "demo")
    moved = prepare_trace_dir(config.trace_dir)
    if moved is not None and out is not None:
        out.print(f"moved the rank traces of earlier runs to {moved}", markup=False)
    # One id for every rank, made here: progress and the report read this run's records only.
    run = new_run_id()
    watcher = Progress(config, out, run=run) if out is not None else None
    started = time.monotonic()
    if watcher is not None:
        watcher.start()
    fn = megatron_rank_main if config.trainer == "megatron" else rank_main
    common: dict[str, Any] = {
        "timeout_s": config.run_timeout_s,
        "kwargs": {**config.to_kwargs(), "run_id": run},
        "pg_timeout_s": config.pg_timeout_s,
        "linger_s": config.linger_s,
    }
    outcomes: Sequence[Any]
    try:
        if config.launcher == "ray":
            from miles_fsm.launch.ray_actors import run_ranks_ray

            outcomes = run_ranks_ray(fn, config.ranks, **common)
        else:
            # The Flight Recorder on in every rank: its dumps beside the traces explain a hang.
            outcomes = run_ranks(fn, config.ranks, env={FR_ENV: str(DEFAULT_BUFFER)}, **common)
    finally:
        if watcher is not None:
            watcher.stop()
    return result_of(config, run, outcomes, time.monotonic() - started)


def result_of(config: DemoConfig, run: str, outcomes: Any, wall: float) -> DemoResult:
    """The run's result from the ranks' outcomes and this run's traces (whatever launched the ranks)."""
    traces = _read_traces(config.trace_dir, config.ranks, run)
    failed = not all(o.ok for o in outcomes)
    replay = diagnose(list(traces.values()), expected=range(config.ranks)) if failed and traces else None
    culprits, diagnosis = blame(outcomes, traces, replay)
    return DemoResult(
        config=config,
        run_id=run,
        outcomes=tuple(outcomes),
        wall_s=wall,
        verified={r: traces[r].verified if r in traces else 0 for r in range(config.ranks)},
        culprits=culprits,
        diagnosis=diagnosis,
    )


def _read_traces(trace_dir: Path, ranks: int, run: str) -> dict[int, RankTrace]:
    """This run's traces, folded by the replay reader: a rank whose file is not this run's has none."""
    files = {r: p for r in range(ranks) if trace_run(p := trace_path(trace_dir, r)) == run}
    return {t.rank: t for t in read_ranks(files)} if files else {}
