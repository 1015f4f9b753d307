"""The memory drift snapshot's cost per transition, against the transition's own time: one JSON file.

Every committed transition takes one snapshot (states/drift.py): the drivers'
per-tag accounting, one read of /proc/self/statm, the tracker's update and the
``memory_snapshot`` record. This times that (the machine's ``on_commit``) on
every transition of N cycles and sets it beside the transition's duration.

    python benchmarks/bench_drift.py --out bench-out/drift_cpu.json            # CPU: the reference stack
    python benchmarks/bench_drift.py --device cuda --out /tmp/drift_h200.json  # CUDA: torch_memory_saver
    python benchmarks/bench_drift.py --cycles 50 --ballast-gib 2.5 --out bench-out/drift_cpu.json

Beside the cost, each strategy's run is a false-positive run under the
default ``DriftConfig()``: ``findings`` must be 0, and ``noise`` gives, per
figure and state, the largest cycle-to-cycle step and the largest growth over
a run that never fell, against ``abs_bytes`` (64 MiB). ``--ballast-gib`` first
makes the process that large (written, resident); ``--leak-from C`` then adds
an untagged leak run: one written buffer of ``--leak-mib`` (64) kept per cycle
from cycle C in a plain list, with the cycle it was named at and its slope.

``--device cuda`` runs the reference trainer and engine on torch_memory_saver
(``TmsMemorySaver``), whose accounting the snapshot reads; the data-moving
transitions (offload: the host backup; resume: the restore) are the ones the
issue's 1% bound is about.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _stack(device: str, strategy: str, dim: int, layers: int, vocab: int) -> tuple[Any, Any]:
    import torch

    from miles_fsm.config import LifecycleConfig, VerifyConfig
    from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
    from miles_fsm.drivers.reference.trainer import ModelConfig, ReferenceTrainer, TrainerConfig
    from miles_fsm.states import Strategy
    from miles_fsm.states.lifecycle import Lifecycle

    if device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_drift: --device cuda needs a CUDA device (torch.cuda.is_available() is False)")
        from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

        saver: Any = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    else:
        from miles_fsm.drivers.cpu_memory import CpuMemorySaver

        saver = CpuMemorySaver()
    model = ModelConfig(dim=dim, layers=layers, vocab=vocab, heads=8, max_seq=64)
    trainer = ReferenceTrainer(config=TrainerConfig(model=model, strategy=Strategy(strategy)), saver=saver)
    engine = ReferenceEngine(config=EngineConfig(model=model), saver=saver)
    trace_dir = Path(tempfile.mkdtemp(prefix="miles-fsm-bench-drift-"))
    lc = Lifecycle(trainer=trainer, engine=engine,
                   config=LifecycleConfig(verify=VerifyConfig(cycles=0), trace_dir=trace_dir))  # fmt: skip
    return lc, trainer


def _snapshots(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    return [r for r in (json.loads(x) for x in lines if '"memory_snapshot"' in x) if r.get("event") == "memory_snapshot"]


def _noise(path: Path, warmup: int = 2) -> dict[str, Any]:
    """Per figure and state past the warm-up: the largest |step| between cycles, and the most a never-falling run grew."""
    series: dict[str, list[int]] = {}
    for r in _snapshots(path):
        if r["epoch"] <= warmup:
            continue
        figures = [("device", t, v) for t, v in (r.get("device") or {}).items()]
        figures += [("host", t, v) for t, v in (r.get("host") or {}).items()] + [("rss", "process", r.get("rss"))]
        for kind, tag, v in figures:
            if isinstance(v, int):
                series.setdefault(f"{kind} {tag} @ {r['state']}", []).append(v)
    out = {}
    for name, ys in series.items():
        steps = [b - a for a, b in zip(ys, ys[1:], strict=False)]
        run = best = 0
        for d in steps:
            run = run + d if d >= 0 else 0
            best = max(best, run)
        out[name] = {"max_step": max((abs(d) for d in steps), default=0), "max_run_growth": best}
    worst = max(out.values(), key=lambda v: v["max_run_growth"], default=None)
    return {"worst_run_growth": worst["max_run_growth"] if worst else 0,
            "worst_step": max((v["max_step"] for v in out.values()), default=0), "figures": out}  # fmt: skip


def leak_run(args: argparse.Namespace) -> dict[str, Any]:
    """An untagged leak of ``--leak-mib`` per cycle from ``--leak-from``: when the live check named it, and how."""
    import warnings

    import torch

    from miles_fsm.states import State, Trigger
    from miles_fsm.states.drift import MemoryDriftWarning

    lc, _ = _stack(args.device, "backup", args.dim, args.layers, args.vocab)
    kept: list[Any] = []
    named: list[dict[str, Any]] = []
    seen = 0
    with lc, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemoryDriftWarning)
        lc.start()
        wake = lc.definition.path(State.PAUSED, State.TRAINING) or ()
        for c in range(1, args.leak_cycles + 1):
            if c >= args.leak_from:
                kept.append(torch.ones(args.leak_mib << 20, dtype=torch.uint8))  # a user's list: no tag
            lc.offload()
            lc.pause()
            for trig in wake:
                lc.fire(Trigger(trig))
            named += [{"named_at": c, **asdict(w.message.finding)} for w in caught[seen:]
                      if isinstance(w.message, MemoryDriftWarning)]  # fmt: skip
            seen = len(caught)
    kept.clear()
    return {"leak_from": args.leak_from, "leak_bytes": args.leak_mib << 20, "cycles": args.leak_cycles,
            "named": named, "refitted": [asdict(f) for f in lc.drift.tracker.findings()],
            "rss_at_baseline": next(r["rss"] for r in _snapshots(lc.tracer.path) if r["epoch"] == 3)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from miles_fsm.states import State, Trigger

    out: dict[str, Any] = {"device": args.device, "cycles": args.cycles, "python": platform.python_version(),
                           "model": {"dim": args.dim, "layers": args.layers, "vocab": args.vocab},
                           "strategies": {}}  # fmt: skip
    for strategy in args.strategies:
        lc, trainer = _stack(args.device, strategy, args.dim, args.layers, args.vocab)
        machine = lc._machine  # the benchmark times the hook the machine calls: it wraps it in place
        observe = machine._on_commit
        rows: list[tuple[str, float, float]] = []

        def timed(result: Any, observe: Any = observe, rows: list[tuple[str, float, float]] = rows) -> Any:
            t0 = time.perf_counter()
            found = observe(result)
            rows.append((result.trigger.value, result.duration_s, time.perf_counter() - t0))
            return found

        machine._on_commit = timed
        with lc:
            lc.start()
            wake = lc.definition.path(State.PAUSED, State.TRAINING) or ()
            for _ in range(args.cycles):
                lc.offload()
                lc.pause()
                for trig in wake:
                    lc.fire(Trigger(trig))
        noise = _noise(lc.tracer.path)
        per: dict[str, Any] = {}
        for trig in sorted({r[0] for r in rows}):
            mine = [r for r in rows if r[0] == trig]
            tx = statistics.median(r[1] for r in mine)
            snap = statistics.median(r[2] for r in mine)
            per[trig] = {"n": len(mine), "transition_median_s": tx, "snapshot_median_s": snap,
                         "snapshot_max_s": max(r[2] for r in mine), "ratio": snap / tx if tx else None}  # fmt: skip
        out["strategies"][strategy] = {"triggers": per, "findings": [asdict(f) for f in lc.drift.tracker.findings()],
                                       "host_bytes": trainer.backup_host_bytes(), "noise": noise}  # fmt: skip
        print(f"{strategy}: " + ", ".join(f"{t} {v['snapshot_median_s'] * 1e6:.0f} us / "
                                          f"{v['transition_median_s'] * 1e3:.2f} ms ({(v['ratio'] or 0) * 100:.2f}%)"
                                          for t, v in per.items()), flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where the JSON goes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--strategies", nargs="+", choices=("rematerialize", "backup"), default=["rematerialize", "backup"])
    p.add_argument("--ballast-gib", type=float, default=0.0, help="make the process this large first (written)")
    p.add_argument("--leak-from", type=int, default=None, help="add an untagged leak run, leaking from this cycle")
    p.add_argument("--leak-mib", type=int, default=64)
    p.add_argument("--leak-cycles", type=int, default=12)
    args = p.parse_args(argv)
    import torch

    ballast = torch.ones(int(args.ballast_gib * (1 << 30)), dtype=torch.uint8)  # resident: every page written
    result = run(args)
    result["ballast_bytes"] = ballast.numel()
    if args.leak_from is not None:
        result["leak"] = leak_run(args)
        named = result["leak"]["named"]
        print("leak: " + (", ".join(f"{n['kind']} {n['tag']} at cycle {n['named_at']}, {n['slope'] / (1 << 20):.1f} "
                                    "MiB/cycle" for n in named) or "NOT NAMED"), flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # --device cuda makes torch_memory_saver region tensors
