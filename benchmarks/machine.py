"""What every benchmark JSON records beside its figures: the machine, a speed anchor, the spread.

A figure measured on a loaded or slower machine is only comparable with
another through an anchor measured in the same run; the spread over rounds
says how far a single figure can be trusted.

    # run as `python benchmarks/bench_x.py`: benchmarks/ is on sys.path
    from machine import describe_machine, spread

    result = {"machine": describe_machine(), "guard_us": spread(per_round_us), ...}
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import orjson

__all__ = ["describe_machine", "plain_write_us", "ratio_spread", "sha256_core_MBps", "spread"]


def sha256_core_MBps(nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """hashlib SHA256 on one core, MB/s, best of ``repeats``: the CPU's speed, whatever the load."""
    data = bytes(nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def plain_write_us(n: int = 20000, record: dict[str, Any] | None = None) -> float:
    """One orjson record rendered and written with one ``write(2)`` to an unbuffered file, us.

    The floor under any per-line trace writer: what a trace record costs
    without structlog, sequence numbers or clocks.
    """
    record = record or {"event": "action_finished", "epoch": 1, "state": "TRAINING", "trigger": "offload",
                        "action": "backup(actor)", "duration_s": 0.001, "seq": 0}
    with tempfile.TemporaryDirectory() as d, open(Path(d) / "plain.jsonl", "ab", buffering=0) as f:
        t0 = time.perf_counter()
        for _ in range(n):
            f.write(orjson.dumps(record) + b"\n")
        return (time.perf_counter() - t0) / n * 1e6


def describe_machine() -> dict[str, Any]:
    """Platform, cores, load, versions, commit, and the two speed anchors, measured now."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - every benchmark here has torch
        torch_version = None
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "loadavg_1m": os.getloadavg()[0],
        "commit": _commit(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "anchors": {"sha256_core_MBps": sha256_core_MBps(), "plain_write_us": plain_write_us()},
    }


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and count of per-round figures."""
    vals = sorted(values)
    if not vals:
        raise ValueError("spread() of no values: a benchmark round produced nothing")
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "rounds": len(vals)}


def ratio_spread(numerators: Iterable[float], denominators: Iterable[float]) -> dict[str, Any]:
    """The spread of per-round ratios, each round's two sides measured together."""
    pairs = list(zip(numerators, denominators, strict=True))
    return spread(a / b for a, b in pairs)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
