"""The memory drift snapshot's cost per transition, against the transition's own time: one JSON file.

Every committed transition takes one snapshot (states/drift.py): the drivers'
per-tag accounting, one read of /proc/self/statm, the tracker's update and the
``memory_snapshot`` record. This times that (the machine's ``on_commit``) on
every transition of N cycles and sets it beside the transition's duration.

    python benchmarks/bench_drift.py --out bench-out/drift_cpu.json            # CPU: the reference stack
    python benchmarks/bench_drift.py --device cuda --out /tmp/drift_h200.json  # CUDA: torch_memory_saver

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
        per: dict[str, Any] = {}
        for trig in sorted({r[0] for r in rows}):
            mine = [r for r in rows if r[0] == trig]
            tx = statistics.median(r[1] for r in mine)
            snap = statistics.median(r[2] for r in mine)
            per[trig] = {"n": len(mine), "transition_median_s": tx, "snapshot_median_s": snap,
                         "snapshot_max_s": max(r[2] for r in mine), "ratio": snap / tx if tx else None}  # fmt: skip
        out["strategies"][strategy] = {"triggers": per, "findings": len(lc.drift.tracker.findings()),
                                       "host_bytes": trainer.backup_host_bytes()}  # fmt: skip
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
    args = p.parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # --device cuda makes torch_memory_saver region tensors
