"""Guard cost against a bare gloo all_reduce of the same size, and trace cost per event.

    python benchmarks/bench_guard.py --out bench-out/guard.json [--ranks 2 4 8] [--iters 400]

Both are measured in the same processes, interleaved in blocks, so machine
noise hits both alike. The guard's cost includes publishing the intent to
the store (the parent hosts it, as in the demo and in torchrun).
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

from miles_fsm.launch import RankContext, run_ranks


def _rank(ctx: RankContext) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from miles_fsm.guard import Guard
    from miles_fsm.plan import Collective, Intent, TensorSet, TensorSpec

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    guard = Guard.from_default_group(timeout_s=60)
    tensors = TensorSet(tuple(TensorSpec(f"layers.{i}.weight", (1024, 1024), "bfloat16") for i in range(200)))
    buf = torch.zeros(2, dtype=torch.int64)
    iters, block = ctx.kwargs["iters"], 20
    bare: list[float] = []
    guarded: list[float] = []
    epoch = 0
    for _ in range(iters // block):
        dist.barrier(group=group)
        for _ in range(block):
            t0 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            bare.append(time.perf_counter() - t0)
        dist.barrier(group=group)
        for _ in range(block):
            epoch += 1
            # A fresh intent each time: the guard's hashing is part of its cost.
            intent = Intent(
                epoch=epoch,
                trigger="sync",
                source="REMATERIALIZED",
                dest="SYNCED",
                strategy="rematerialize",
                collectives=(Collective("all_gather", "dp", "bfloat16", 200 * 1024 * 1024),),
                tensors=tensors,
            )
            t0 = time.perf_counter()
            guard.agree(intent, state="REMATERIALIZED")
            guarded.append(time.perf_counter() - t0)
    return {"bare_s": statistics.median(bare), "guard_s": statistics.median(guarded)}


def trace_event_cost(n: int = 20000) -> float:
    from miles_fsm.tracing import Tracer

    with tempfile.TemporaryDirectory() as d:
        t = Tracer(d, rank=0, world=1)
        t0 = time.perf_counter()
        for i in range(n):
            t.emit("action_finished", epoch=1, state="TRAINING", trigger="offload", action="backup(actor)", duration_s=0.1)
        cost = (time.perf_counter() - t0) / n
        t.close()
    return cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=400)
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        outs = run_ranks(_rank, world, timeout_s=600, kwargs={"iters": args.iters})
        failed = [o for o in outs if not o.ok]
        if failed:
            print(f"world {world}: rank failures: {[(o.rank, o.error) for o in failed]}", file=sys.stderr)
            return 1
        bare = statistics.median(o.result["bare_s"] for o in outs)
        guard = statistics.median(o.result["guard_s"] for o in outs)
        rows.append({"ranks": world, "bare_all_reduce_us": bare * 1e6, "guard_us": guard * 1e6, "ratio": guard / bare})
        print(f"ranks={world}: bare all_reduce {bare * 1e6:.0f} us, guard {guard * 1e6:.0f} us, ratio {guard / bare:.2f}")
    per_event = trace_event_cost()
    print(f"trace: {per_event * 1e6:.2f} us per event")
    result = {
        "benchmark": "guard",
        "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "torch": __import__("torch").__version__,
        "iters": args.iters,
        "guard": rows,
        "trace_event_us": per_event * 1e6,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
