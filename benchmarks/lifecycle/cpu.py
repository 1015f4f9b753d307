"""Without CUDA: the reference trainer through a guarded, traced Lifecycle on 2 gloo ranks."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from .limits import host_copy_GBps
from .report import progress
from .transitions import CYCLE, OFFLOAD, WAKE, phase, trace_events, transition_row
from .verify import verification_bench


def _cpu_rank(ctx: Any) -> dict[str, Any]:
    """One rank of the CPU run: the reference trainer through a guarded, traced Lifecycle."""
    import torch

    from miles_fsm import Guard, GuardConfig, Lifecycle, LifecycleConfig, Strategy, VerifyConfig
    from miles_fsm.digest import default_threads
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.reference.trainer import ModelConfig, ReferenceTrainer, TrainerConfig

    kw = ctx.kwargs
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    limits = kw["limits"]
    limits["host_copy_GBps_per_rank"] = host_copy_GBps()
    model = ModelConfig(**kw["model"])
    out: dict[str, Any] = {"strategies": {}}
    for strategy in kw["strategies"]:
        if ctx.rank == 0:
            progress(f"  {strategy}: {kw['cycles']} cycles ({kw['verified']} verified)")
        saver = CpuMemorySaver()
        trainer = ReferenceTrainer(config=TrainerConfig(model=model, strategy=Strategy(strategy)), saver=saver)
        trace_dir = Path(kw["trace_dir"]) / strategy
        lc = Lifecycle(
            trainer=trainer,
            config=LifecycleConfig(
                guard=GuardConfig(timeout_s=60),
                verify=VerifyConfig(cycles=None if kw["verified"] == "all" else kw["verified"],
                                    ci_verifies_every_cycle=False),
                trace_dir=trace_dir,
            ),
            guard=Guard.from_default_group(timeout_s=60),
        )
        lc.start()
        backed = sum(r.nbytes for r in saver.regions() if r.backup)
        cycles, results = [], []
        gen = torch.Generator().manual_seed(ctx.rank)
        for c in range(kw["cycles"]):
            tokens = torch.randint(0, model.vocab, (4, 16), generator=gen)
            trainer.train_step(tokens, torch.zeros(4), prompt_len=4)
            rs = {}
            for name in CYCLE:
                rs[name] = lc.fire(name)
            results.append(rs)
            cycles.append(
                {
                    "epoch": lc.epoch,
                    "verified": lc.verifies(lc.epoch),
                    # The saver's region backup of `default` crosses on pause and comes back on resume.
                    "memory_bytes": {"offload": backed, "pause": 0, "rematerialize": backed, "sync": 0, "resume": 0},
                }
            )
        lc.close()
        events = trace_events(trace_dir / f"rank-{ctx.rank}.jsonl")
        for cyc, rs in zip(cycles, results):
            cyc["transitions"] = {
                n: transition_row(r, events.get((r.epoch, n), 0), cyc["memory_bytes"][n], limits) for n, r in rs.items()
            }
            restored = sum(s.bytes_moved or 0 for s in rs["rematerialize"].steps if s.name.startswith("restore"))
            cyc["crossed"] = {
                # Offload: backup(actor) and the saver's copy of `default`.
                "offload": cyc["transitions"]["offload"]["bytes"],
                "pause": cyc["transitions"]["pause"]["bytes"],
                # Wake: the saver's copy back and restore(actor); the cast stays in memory, the sync on gloo.
                "rematerialize": cyc["transitions"]["rematerialize"]["memory_bytes"] + restored,
                "sync": 0,
            }
            cyc["offload"] = phase(cyc, OFFLOAD, "crossed", limits["host_copy_GBps_per_rank"])
            cyc["wake"] = phase(cyc, WAKE, "crossed", limits["host_copy_GBps_per_rank"])
        out["strategies"][strategy] = {
            "cycles": cycles,
            "host_bytes": {
                "trainer_copies": trainer.backup_host_bytes(),
                "saver_backup_while_paused": backed,
            },
            "state": lc.state.value,
            "bf16_param_bytes": sum(t.numel() * t.element_size() for t in trainer.params.values()),
            "tensor_bytes": sum(t.numel() * t.element_size() for t in trainer.tensors().values()),
        }
        if ctx.rank == 0 and strategy == kw["strategies"][0]:
            progress("  verification: pipelined, naive and threaded digests, a warm-up and 3 rounds each")
            tensors = {**trainer.tensors()}
            out["verification"] = verification_bench(tensors, threads=default_threads(), sync=lambda: None)
    return out


def run_cpu(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    from miles_fsm.launch.local import run_ranks

    model = {"vocab": args.cpu_vocab, "dim": args.cpu_dim, "layers": args.cpu_layers, "heads": 8, "max_seq": 32}
    with tempfile.TemporaryDirectory(prefix="miles-fsm-bench-") as d:
        outcomes = run_ranks(
            _cpu_rank,
            2,
            timeout_s=600,
            kwargs={
                "model": model,
                "strategies": args.strategies,
                "cycles": args.cycles,
                "verified": args.verified,
                "trace_dir": d,
                "limits": limits,
            },
        )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError("CPU bench rank failed: " + "; ".join(
            f"rank {o.rank}: {o.error.traceback if o.error else o.exitcode}" for o in failed))
    r0 = outcomes[0].result
    return {"model": {**model, "ranks": 2}, "strategies": r0["strategies"],
            "verification": r0["verification"], "rank1_strategies": outcomes[1].result["strategies"]}
