"""Time ``miles-fsm demo`` on this machine and write the figures as JSON.

Usage: python benchmarks/bench_demo.py [--out bench-out/demo.json] [--repeats 3]

For each mode: the wall time of the whole CLI (a fresh interpreter, so the
forkserver start and torch import are included), the in-process ``run_demo``
wall time, and the per-phase medians of the summary table. Also one run per
injection kind: how long until the demo exits, and whom it names.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from machine import describe_machine, spread
from rich.console import Console

from miles_fsm.apps.demo import INJECTION_KINDS, DemoConfig, Injection, run_demo
from miles_fsm.states import Strategy


def _cli_wall(mode: str, trace_dir: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "miles_fsm", "demo", "--mode", mode, "--trace-dir", str(trace_dir)],
        check=True, capture_output=True,
    )
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/demo.json"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--guard-timeout", type=float, default=3.0, help="for the injection runs")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="miles-fsm-bench-demo-"))
    console = Console(stderr=True)
    report: dict = {
        "benchmark": "demo",
        "machine": describe_machine(),
        "repeats": args.repeats,
        "defaults": {"ranks": DemoConfig().ranks, "steps": DemoConfig().steps},
        "modes": {},
        "injections": [],
    }
    for mode in Strategy:
        console.log(f"{mode.value}: {args.repeats} CLI runs, then {args.repeats} in-process runs")
        cli = [_cli_wall(mode.value, tmp / f"cli-{mode.value}-{i}") for i in range(args.repeats)]
        runs = [run_demo(DemoConfig(mode=mode, trace_dir=tmp / f"run-{mode.value}-{i}")) for i in range(args.repeats)]
        if not all(r.ok for r in runs):
            raise SystemExit(f"{mode.value}: a demo run failed: {[r.diagnosis for r in runs if not r.ok]}")
        phases = {}
        for row in runs[-1].summary():
            phases[row["name"]] = {
                "median_ms": row["median_s"] * 1e3,
                "bytes_moved": row["bytes_moved"],
                "peak_bytes": row["peak_bytes"],
                "host_bytes": row["host_bytes"],
            }
        report["modes"][mode.value] = {
            "cli_wall_s": {**spread(cli), "all": cli},
            "run_demo_wall_s": spread(r.wall_s for r in runs),
            "phases": phases,
            "held_while_paused": runs[-1].held(),
        }
    for kind in INJECTION_KINDS:
        for mode in Strategy:
            cfg = DemoConfig(
                mode=mode, steps=3, guard_timeout_s=args.guard_timeout,
                injections=(Injection(kind=kind, rank=1, step=2),), trace_dir=tmp / f"inj-{kind}-{mode.value}",
            )
            console.log(f"injection {kind}:1:2 under {mode.value}")
            result = run_demo(cfg)
            report["injections"].append(
                {"kind": kind, "mode": mode.value, "guard_timeout_s": args.guard_timeout, "wall_s": result.wall_s,
                 "exit_code": result.exit_code, "culprits": list(result.culprits)}
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    for mode, row in report["modes"].items():
        console.print(f"{mode}: CLI {row['cli_wall_s']['median']:.2f} s (min {row['cli_wall_s']['min']:.2f}, "
                      f"max {row['cli_wall_s']['max']:.2f}), run_demo {row['run_demo_wall_s']['median']:.2f} s")
    for row in report["injections"]:
        console.print(f"{row['kind']:>10} {row['mode']:>13}: {row['wall_s']:.2f} s, exit {row['exit_code']}, "
                      f"culprits {row['culprits']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
