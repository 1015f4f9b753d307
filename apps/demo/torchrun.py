"""``torchrun --nproc-per-node N -m miles_fsm demo``: each torchrun worker runs one rank of the demo.

torchrun's agent starts the workers, hosts the store and tears the run down
when a worker fails. Every worker runs its rank through
``miles_fsm.launch.torchrun.run_under_torchrun``, which leaves its result or its
error (with fields) in ``<trace-dir>/outcomes/``; rank 0 then waits for the
others' files (the linger), reads the run's traces and prints the report,
and its exit code is the demo's. The run id and the default trace
directory come from torchrun's own run id, so every worker agrees on them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.apps.demo.config import DemoConfig
from miles_fsm.launch.local import RankError, RankOutcome

__all__ = ["TORCHRUN_ENV", "torchrun_demo", "under_torchrun"]

#: Set by torchrun's agent in every worker.
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"


def under_torchrun() -> bool:
    return TORCHRUN_ENV in os.environ and "RANK" in os.environ


def torchrun_run_id() -> str:
    return f"torchrun-{os.environ[TORCHRUN_ENV]}"


def torchrun_demo(config: DemoConfig, out: Any) -> int:
    """Run this worker's rank; on rank 0 also gather every rank's outcome and print the report."""
    from miles_fsm.apps.demo.megatron_rank import megatron_rank_main
    from miles_fsm.apps.demo.rank import rank_main
    from miles_fsm.apps.demo.report import print_result
    from miles_fsm.apps.demo.run import result_of
    from miles_fsm.launch.torchrun import run_under_torchrun

    rank = int(os.environ["RANK"])
    run = torchrun_run_id()
    outcomes_dir = config.trace_dir / "outcomes" / run
    fn = megatron_rank_main if config.trainer == "megatron" else rank_main
    started = time.monotonic()
    try:
        run_under_torchrun(fn, kwargs={**config.to_kwargs(), "run_id": run}, timeout_s=config.pg_timeout_s,
                           out_dir=outcomes_dir)  # fmt: skip
        mine_ok = True
    except Exception:
        mine_ok = False
    if rank != 0:
        return 0 if mine_ok else 1
    outcomes = _gather(outcomes_dir, config.ranks, deadline=time.monotonic() + config.linger_s + 2.0)
    result = result_of(config, run, outcomes, time.monotonic() - started)
    print_result(result, out)
    return result.exit_code


def _gather(folder: Path, ranks: int, *, deadline: float) -> list[RankOutcome]:
    """Every rank's outcome file, waiting for them up to ``deadline``; a rank without one was killed."""
    while time.monotonic() < deadline and not all(_outcome_file(folder, r) for r in range(ranks)):
        time.sleep(0.05)
    outcomes = []
    for r in range(ranks):
        path = _outcome_file(folder, r)
        if path is None:
            outcomes.append(RankOutcome(r, None, killed=True))
            continue
        record = orjson.loads(path.read_bytes())
        if path.name.endswith(".result.json"):
            outcomes.append(RankOutcome(r, 0, record))
        else:
            error = RankError(record.get("error", "?"), record.get("message", ""), record.get("fields") or {})
            outcomes.append(RankOutcome(r, 1, None, error))
    return outcomes


def _outcome_file(folder: Path, rank: int) -> Path | None:
    for kind in ("result", "error"):
        path = folder / f"rank-{rank}.{kind}.json"
        if path.exists():
            return path
    return None
