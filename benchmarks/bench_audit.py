"""The plan audit's cost per verified cycle: Flight Recorder reads + compare, against the same cycle without it.

    python benchmarks/bench_audit.py --out benchmarks/results/audit_cpu.json [--ranks 2] [--rounds 20]

Each rank builds two lifecycles over two reference trainers of the same
size, one audited and one not, both verifying every cycle, with the
recorder on in the process (so the unaudited side pays the recording, which
torch does anyway when it is on, and only the audit's reads differ). Each
round runs one cycle of each behind a barrier, in alternating order; the
ratio is per round. ``fr_read_ms`` is one read of the recorder as the audit
does it at a step boundary, with the buffer as full as the run left it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from machine import describe_machine, ratio_spread, spread
from rich.console import Console

from miles_fsm.flight_recorder import FR_ENV
from miles_fsm.launch.local import RankContext, run_ranks


def _rank(ctx: RankContext) -> dict:
    import torch
    import torch.distributed as dist

    from miles_fsm import flight_recorder as fr
    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.reference.trainer import ModelConfig, ReferenceTrainer, TrainerConfig
    from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
    from miles_fsm.states import State
    from miles_fsm.states.lifecycle import Lifecycle

    torch.set_num_threads(1)
    model = ModelConfig(dim=ctx.kwargs["dim"], layers=ctx.kwargs["layers"])
    lcs = {}
    for name, audit in (("off", False), ("on", True)):
        saver = CpuMemorySaver()
        lc = Lifecycle(
            trainer=ReferenceTrainer(config=TrainerConfig(model=model), saver=saver),
            engine=ReferenceEngine(config=EngineConfig(model=model), saver=saver),
            config=LifecycleConfig(guard=GuardConfig(timeout_s=120), name=name,
                                   verify=VerifyConfig(cycles=None, audit=audit)),  # fmt: skip
        )
        lc.start()
        lcs[name] = lc
    wake = lcs["on"].definition.path(State.PAUSED, State.TRAINING) or ()

    def cycle(lc: Lifecycle) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        lc.offload()
        lc.pause()
        for trig in wake:
            lc.fire(trig)
        return time.perf_counter() - t0

    cycle(lcs["off"]), cycle(lcs["on"])  # warm-up: first-touch allocations and thread pools
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(ctx.kwargs["rounds"]):
        for name in ("on", "off") if i % 2 else ("off", "on"):
            times[name].append(cycle(lcs[name]))
    reads = []
    for _ in range(20):
        t0 = time.perf_counter()
        fr.entries(after=fr.position())
        reads.append((time.perf_counter() - t0) / 2)  # a position and an entries read: one boundary each
    for lc in lcs.values():
        lc.close()
    return {**times, "fr_read_s": statistics.median(reads), "fr_entries": len(fr.entries())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/audit_cpu.json"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fr-buffer", type=int, default=200, help="TORCH_FR_BUFFER_SIZE (entries kept)")
    args = ap.parse_args()
    out = Console(highlight=False, stderr=True)
    out.print(f"plan audit: {args.ranks} ranks, {args.rounds} rounds, model dim {args.dim} x {args.layers} layers")
    outcomes = run_ranks(_rank, args.ranks, timeout_s=600,
                         kwargs={"rounds": args.rounds, "dim": args.dim, "layers": args.layers},
                         env={FR_ENV: str(args.fr_buffer)})  # fmt: skip
    failed = [o for o in outcomes if not o.ok]
    if failed:
        out.print(f"[red]rank failures: {[(o.rank, o.error) for o in failed]}")
        return 1
    # Per round, the slowest rank's cycle: a cycle ends when every rank is through it.
    on = [max(o.result["on"][i] for o in outcomes) for i in range(args.rounds)]
    off = [max(o.result["off"][i] for o in outcomes) for i in range(args.rounds)]
    result = {
        "benchmark": "audit",
        "machine": describe_machine(),
        "ranks": args.ranks,
        "rounds": args.rounds,
        "model": {"dim": args.dim, "layers": args.layers},
        "fr_buffer": args.fr_buffer,
        "cycle_audited_ms": spread(x * 1e3 for x in on),
        "cycle_unaudited_ms": spread(x * 1e3 for x in off),
        "audit_cost_ms": spread((a - b) * 1e3 for a, b in zip(on, off, strict=True)),
        "ratio_audited_to_unaudited": ratio_spread(on, off),
        "fr_read_ms": spread(o.result["fr_read_s"] * 1e3 for o in outcomes),
        "fr_entries_at_end": max(o.result["fr_entries"] for o in outcomes),
    }
    r = result["ratio_audited_to_unaudited"]
    out.print(f"cycle: audited {result['cycle_audited_ms']['median']:.1f} ms, unaudited "
              f"{result['cycle_unaudited_ms']['median']:.1f} ms, ratio {r['median']:.3f} [{r['min']:.3f}, "
              f"{r['max']:.3f}]; one recorder read {result['fr_read_ms']['median']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    out.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
