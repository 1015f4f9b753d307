"""``miles-fsm bench``: offload and wake against the hardware limits, in one JSON file.

One command measures, in the same run:

- the limits: pinned host<->device copy bandwidth each way, device copy
  bandwidth (host memcpy on CPU), the gloo all-reduce latency of 2 ranks
  (and the guard's cost on top of it), SHA256 per core, the cost of one
  trace event;
- full lifecycle cycles, per strategy: each transition's time, the bytes
  its steps and its memory moves copied, the guard time and trace events;
- offload (TRAINING -> PAUSED: ``offload`` + ``pause``) and wake (PAUSED ->
  SYNCED: ``rematerialize`` + ``sync``) as GB/s of the bytes that cross to
  or from the host, against the pinned D2H / H2D limit;
- verification: the chunked, pipelined digest beside the per-tensor
  ``.cpu()`` + hashlib path (and the earlier threaded per-tensor one);
- guard + trace overhead per transition (and, on CPU, in the demo);

then the ratios. On CUDA it runs the Megatron driver over torch_memory_saver
(a >= 1.5 B GPT, the optimizer state kept by the driver's pinned buffers);
without CUDA the reference stack on 2 gloo ranks. ``benchmarks/plot.py``
draws the figures from the JSON.

    miles-fsm bench --out bench-out/lifecycle.json
    python benchmarks/bench_lifecycle.py --out ...   # the same
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "gpu_train_step", "main", "run_bench"]

GiB = 1 << 30
_OFFLOAD = ("offload", "pause")
_WAKE = ("rematerialize", "sync")
_CYCLE = ("offload", "pause", "rematerialize", "sync", "resume")
#: Steps that are verification, not data movement.
_VERIFY_STEPS = ("record_digests", "verify")


# =============================================================== limits


def pinned_limits(nbytes: int = 2 * GiB, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` pinned copy bandwidth each way, GB/s, for torch's pinned memory and a
    ``cudaHostRegister``-ed buffer (what ``HostCopies`` uses); the limit is the better of the two."""
    import torch

    from miles_fsm.drivers.pinned import PinnedConfig, host_buffer

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    hosts = {"alloc": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)}
    registered, _, finalizer = host_buffer(nbytes, pin=True, huge_pages=PinnedConfig().huge_pages)
    hosts["registered"] = registered
    for kind, host in hosts.items():
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            best = float("inf")
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[f"{name}_{kind}_GBps"] = nbytes / best / 1e9
    out["h2d_GBps"] = max(out["h2d_alloc_GBps"], out["h2d_registered_GBps"])
    out["d2h_GBps"] = max(out["d2h_alloc_GBps"], out["d2h_registered_GBps"])
    out["bytes"] = nbytes
    if finalizer is not None:
        finalizer()
    del dev, hosts, registered
    torch.cuda.empty_cache()
    return out


def device_copy_GBps(nbytes: int = 2 * GiB, repeats: int = 5) -> float:
    """Device-to-device copy, bytes copied per second (each byte is read and written once)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def host_copy_GBps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memcpy between two preallocated buffers (the CPU's 'device copy'), bytes per second."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def sha256_core_GBps(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """hashlib SHA256 on one core, GB/s."""
    data = bytes(nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def trace_event_us(n: int = 2000) -> float:
    """The cost of one trace record (structlog + orjson + one write), microseconds."""
    from miles_fsm.tracing import Tracer

    with tempfile.TemporaryDirectory() as d:
        tracer = Tracer(d, rank=0, world=1)
        fields = {"epoch": 1, "trigger": "offload", "state": "TRAINING", "action": "backup(actor)"}
        t0 = time.perf_counter()
        for i in range(n):
            tracer.emit("action_finished", duration_s=0.001, bytes_moved=i, host_bytes=i, mem_before=i,
                        mem_after=i, **fields)
        per = (time.perf_counter() - t0) / n
        tracer.close()
    return per * 1e6


def _gloo_rank(ctx: Any) -> dict[str, float]:
    """All-reduce of the guard's 2 int64 on gloo, bare and through ``Guard.agree``, interleaved."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from miles_fsm.guard import Guard
    from miles_fsm.plan import Intent, TensorSet

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    guard = Guard.from_default_group(timeout_s=60)
    buf = torch.zeros(2, dtype=torch.int64)
    tensors = TensorSet(())
    bare, guarded = [], []
    iters = ctx.kwargs["iters"]
    for block in range(iters // 20):
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            bare.append(time.perf_counter() - t0)
        for i in range(20):
            intent = Intent(epoch=block * 20 + i, trigger="sync", source="REMATERIALIZED", dest="SYNCED",
                            strategy="rematerialize", collectives=(), tensors=tensors)
            t0 = time.perf_counter()
            guard.agree(intent, state="REMATERIALIZED")
            guarded.append(time.perf_counter() - t0)
    dist.barrier()
    return {"allreduce_us": statistics.median(bare) * 1e6, "guard_us": statistics.median(guarded) * 1e6}


def gloo_latency(iters: int = 400) -> dict[str, float]:
    """Median gloo all-reduce latency of 2 local ranks, and the guard's, microseconds (rank 0)."""
    from miles_fsm.launch import run_ranks

    outcomes = run_ranks(_gloo_rank, 2, timeout_s=120, kwargs={"iters": iters})
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"gloo latency ranks failed: {failed}")
    r = outcomes[0].result
    return {"ranks": 2, "iters": iters, **r}


# ================================================================ traces


def _trace_events(trace_file: Path) -> dict[tuple[int, str], int]:
    """Records per (epoch, trigger) transition, from one rank's trace."""
    import orjson

    counts: dict[tuple[int, str], int] = {}
    current: tuple[int, str] | None = None
    for line in trace_file.read_bytes().splitlines():
        rec = orjson.loads(line)
        event = rec.get("event")
        if event == "transition_started":
            current = (rec["epoch"], rec["trigger"])
            counts[current] = 0
        if current is not None:
            counts[current] += 1
            if event in ("transition_finished", "transition_failed"):
                current = None
    return counts


def _transition_row(r: Any, events: int, moved_extra: int, limits: Mapping[str, Any]) -> dict[str, Any]:
    steps = {s.name: s.duration_s for s in r.steps}
    verify_s = sum(v for k, v in steps.items() if k.startswith(_VERIFY_STEPS))
    steps_s = sum(steps.values())
    trace_s = events * limits["trace_event_us"] * 1e-6
    has_guard = any(s.name.startswith("param_sync") for s in r.steps) or r.guard_s > 0
    guard_model_s = limits["gloo"]["guard_us"] * 1e-6 if has_guard else 0.0
    overhead = max(r.guard_s, guard_model_s) + trace_s
    return {
        "s": r.duration_s,
        "bytes": (r.bytes_moved or 0) + moved_extra,
        "step_bytes": r.bytes_moved,
        "memory_bytes": moved_extra,
        "steps_s": steps,
        "verify_s": verify_s,
        "guard_s": r.guard_s,
        "guard_model_s": guard_model_s,
        "events": events,
        "trace_s": trace_s,
        "nonstep_s": r.duration_s - steps_s,
        "guard_trace_fraction": overhead / r.duration_s if r.duration_s > 0 else None,
    }


def _phase(
    cycle: Mapping[str, Any], names: Sequence[str], cross: str, limit_GBps: float | None, wall_s: float | None = None
) -> dict[str, Any]:
    """One phase (offload or wake) of a cycle. ``wall_s``: measured until the device finished
    (else the transitions' own times); verification steps are taken out for the data path."""
    rows = [cycle["transitions"][n] for n in names]
    s = wall_s if wall_s is not None else sum(r["s"] for r in rows)
    data_s = s - sum(r["verify_s"] for r in rows)
    nbytes = sum(cycle[cross][n] for n in names)
    gbps = nbytes / data_s / 1e9 if data_s > 0 else None
    return {
        "s": s,
        "data_path_s": data_s,
        "host_bytes_crossed": nbytes,
        "GBps": gbps,
        "limit_GBps": limit_GBps,
        "vs_limit": gbps / limit_GBps if gbps is not None and limit_GBps else None,
    }


# ================================================================ verification


def _naive_digests(tensors: Mapping[str, Any]) -> dict[str, str]:
    """The baseline: per tensor, ``.cpu()`` then one hashlib SHA256, one after another."""
    out = {}
    for name, t in tensors.items():
        host = t.detach().cpu().contiguous()
        out[name] = hashlib.sha256(host.reshape(-1).view(__import__("torch").uint8).numpy()).hexdigest()
    return out


def _threaded_per_tensor(tensors: Mapping[str, Any], threads: int) -> dict[str, str]:
    """The previous miles_fsm.digest: one plain SHA256 per tensor (``.to('cpu')`` each), on a thread pool."""
    from miles_fsm.digest import tensor_sha256

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(tensors, pool.map(tensor_sha256, tensors.values())))


def verification_bench(tensors: Mapping[str, Any], *, threads: int, sync: Any) -> dict[str, Any]:
    """The three digest paths over the same tensors, timed in the same run."""
    from miles_fsm.digest import DIGEST_SCHEME, digest_tensors

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    first = next(iter(tensors))
    t0 = time.perf_counter()
    digest_tensors({first: tensors[first]}, threads=threads)  # staging ring, allocated once per process
    warm_s = time.perf_counter() - t0
    out: dict[str, Any] = {"scheme": DIGEST_SCHEME, "bytes": nbytes, "tensors": len(tensors), "threads": threads,
                           "first_call_setup_s": warm_s}
    runs = {}
    for name, fn in (
        ("pipelined", lambda: digest_tensors(tensors, threads=threads)),
        ("naive_per_tensor", lambda: _naive_digests(tensors)),
        ("threaded_per_tensor", lambda: _threaded_per_tensor(tensors, threads)),
        ("pipelined_again", lambda: digest_tensors(tensors, threads=threads)),
    ):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        runs[name] = (time.perf_counter() - t0, result)
    best = min(runs["pipelined"][0], runs["pipelined_again"][0])
    out["pipelined_s"] = best
    out["naive_per_tensor_s"] = runs["naive_per_tensor"][0]
    out["threaded_per_tensor_s"] = runs["threaded_per_tensor"][0]
    out["pipelined_GBps"] = nbytes / best / 1e9
    out["naive_per_tensor_GBps"] = nbytes / out["naive_per_tensor_s"] / 1e9
    out["threaded_per_tensor_GBps"] = nbytes / out["threaded_per_tensor_s"] / 1e9
    out["speedup_vs_naive"] = out["naive_per_tensor_s"] / best
    out["speedup_vs_threaded"] = out["threaded_per_tensor_s"] / best
    out["stable"] = runs["pipelined"][1] == runs["pipelined_again"][1]
    # The pipelined (device) path must give the definition's digest, computed here on the host.
    from miles_fsm.digest import tensor_digest

    largest = max(tensors, key=lambda n: tensors[n].numel() * tensors[n].element_size())
    sample = list(dict.fromkeys([*list(tensors)[:3], largest]))
    out["matches_host_definition"] = all(
        tensor_digest(tensors[n].detach().cpu()) == runs["pipelined"][1][n] for n in sample
    )
    return out


# ================================================================ CPU: reference stack


def _cpu_rank(ctx: Any) -> dict[str, Any]:
    """One rank of the CPU run: the reference trainer through a guarded, traced Lifecycle."""
    import torch

    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.digest import default_threads
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.reference import ModelConfig, ReferenceTrainer, TrainerConfig
    from miles_fsm.guard import Guard
    from miles_fsm.states.lifecycle import Lifecycle
    from miles_fsm.states import Strategy

    kw = ctx.kwargs
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    limits = kw["limits"]
    limits["host_copy_GBps_per_rank"] = host_copy_GBps()
    model = ModelConfig(**kw["model"])
    out: dict[str, Any] = {"strategies": {}}
    for strategy in kw["strategies"]:
        saver = CpuMemorySaver()
        trainer = ReferenceTrainer(config=TrainerConfig(model=model, strategy=Strategy(strategy)), saver=saver)
        trace_dir = Path(kw["trace_dir"]) / strategy
        lc = Lifecycle(
            trainer=trainer,
            config=LifecycleConfig(
                guard=GuardConfig(timeout_s=60),
                verify=VerifyConfig(cycles=kw["verified"], ci_verifies_every_cycle=False),
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
            for name in _CYCLE:
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
        events = _trace_events(trace_dir / f"rank-{ctx.rank}.jsonl")
        for cyc, rs in zip(cycles, results):
            cyc["transitions"] = {
                n: _transition_row(r, events.get((r.epoch, n), 0), cyc["memory_bytes"][n], limits) for n, r in rs.items()
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
            cyc["offload"] = _phase(cyc, _OFFLOAD, "crossed", limits["host_copy_GBps_per_rank"])
            cyc["wake"] = _phase(cyc, _WAKE, "crossed", limits["host_copy_GBps_per_rank"])
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
            tensors = {**trainer.tensors()}
            out["verification"] = verification_bench(tensors, threads=default_threads(), sync=lambda: None)
    return out


def run_cpu(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    from miles_fsm.launch import run_ranks

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


def demo_overhead(limits: Mapping[str, Any]) -> dict[str, Any]:
    """Guard + trace overhead per transition in ``miles-fsm demo`` (defaults: 2 ranks, 4 steps), from its traces."""
    import orjson

    from miles_fsm.apps.demo import DemoConfig, run_demo

    out: dict[str, Any] = {}
    for label, kw in (("default", {}), ("dim256_layers4", {"dim": 256, "layers": 4})):
        with tempfile.TemporaryDirectory(prefix="miles-fsm-demo-") as d:
            result = run_demo(DemoConfig(trace_dir=Path(d), **kw))
            rows: dict[str, list[dict[str, float]]] = {}
            for rank in range(result.config.ranks):
                cur: dict[str, Any] | None = None
                for line in (Path(d) / f"rank-{rank}.jsonl").read_bytes().splitlines():
                    rec = orjson.loads(line)
                    ev = rec["event"]
                    if ev == "transition_started":
                        cur = {"trigger": rec["trigger"], "steps_s": 0.0, "guard_s": 0.0, "events": 1}
                        continue
                    if cur is None:
                        continue
                    cur["events"] += 1
                    if ev == "action_finished":
                        cur["steps_s"] += rec["duration_s"]
                    elif ev == "guard_passed":
                        cur["guard_s"] = rec["duration_s"]
                    elif ev == "transition_finished":
                        dur = rec["duration_s"]
                        guard_model = limits["gloo"]["guard_us"] * 1e-6 if cur["guard_s"] > 0 else 0.0
                        trace_s = cur["events"] * limits["trace_event_us"] * 1e-6
                        rows.setdefault(cur["trigger"], []).append(
                            {
                                "s": dur,
                                "guard_wait_s": cur["guard_s"],
                                "guard_trace_fraction": (guard_model + trace_s) / dur,
                                "nonstep_fraction": (dur - cur["steps_s"]) / dur,
                            }
                        )
                        cur = None
        out[label] = {
            "ok": result.ok,
            "config": {"dim": result.config.dim, "layers": result.config.layers, "ranks": result.config.ranks,
                       "steps": result.config.steps},
            "transitions": {
                t: {
                    "n": len(v),
                    "median_s": statistics.median(x["s"] for x in v),
                    "median_guard_trace_fraction": statistics.median(x["guard_trace_fraction"] for x in v),
                    "max_guard_trace_fraction": max(x["guard_trace_fraction"] for x in v),
                    "median_guard_wait_fraction": statistics.median(x["guard_wait_s"] / x["s"] for x in v),
                    "median_nonstep_fraction": statistics.median(x["nonstep_fraction"] for x in v),
                }
                for t, v in rows.items()
            },
        }
    return out


# ================================================================ GPU: megatron + torch_memory_saver


def _build_gpt(args: argparse.Namespace, saver: Any) -> dict[str, Any]:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

    from miles_fsm.drivers.megatron import coalesce_optimizer_state, ddp_buffers_in_tags

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
    )
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                   max_sequence_length=args.seq)
    model = Float16Module(config, gpt.cuda())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=True
    )
    with ddp_buffers_in_tags(saver):
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    torch.cuda.empty_cache()
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
    state = {"chunks": [ddp], "params": sum(p.numel() for p in model.parameters()), "args": args}
    # The optimizer and its state (Adam creates it on the first step) are built outside any
    # region, then moved into ONE allocation under `default`, without a region backup: the
    # driver keeps the state (optimizer_offload="driver"), and one mapping pauses in a millisecond.
    state["optimizer"] = get_megatron_optimizer(opt_config, [ddp])
    gpu_train_step(state, step=0)

    def allocate(nbytes: int) -> torch.Tensor:
        with saver.region("default", backup=False):
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    state["optimizer_flat_bytes"] = coalesce_optimizer_state(state["optimizer"], allocate)
    torch.cuda.empty_cache()
    return state


def gpu_train_step(state: dict[str, Any], *, step: int) -> float:
    """One bf16 GPT train step on CUDA over ``state["chunks"]`` and ``state["optimizer"]``."""
    import torch

    args = state["args"]
    g = torch.Generator(device="cuda").manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    for chunk in state["chunks"]:
        chunk.zero_grad_buffer()
    state["optimizer"].zero_grad()
    loss = sum(c(tokens, position_ids, None, labels=labels).float().mean() for c in state["chunks"])
    loss.backward()
    for chunk in state["chunks"]:
        chunk.finish_grad_sync()
    ok, _, _ = state["optimizer"].step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped")
    return float(loss.detach())


class _TimedMemory:
    """The saver the driver pauses and resumes through, timing each call (no extra synchronization)."""

    def __init__(self, saver: Any) -> None:
        self._saver = saver
        self.events: list[dict[str, Any]] = []

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        t0 = time.perf_counter()
        self._saver.pause(tag, synchronize=synchronize)
        self.events.append({"op": "pause", "tag": tag, "s": time.perf_counter() - t0})

    def resume(self, tag: str) -> None:
        t0 = time.perf_counter()
        self._saver.resume(tag)
        self.events.append({"op": "resume", "tag": tag, "s": time.perf_counter() - t0})

    def resident_bytes(self, tags: Any = None) -> int:
        return self._saver.resident_bytes(tags)


def run_gpu(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    import socket

    import torch
    import torch.distributed as dist

    from miles_fsm.config import GuardConfig, LifecycleConfig
    from miles_fsm.digest import default_threads, digest_tensors
    from miles_fsm.drivers.megatron import OPTIMIZER_KEY, MegatronTrainer
    from miles_fsm.drivers.megatron_config import MegatronDriverConfig
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver
    from miles_fsm.states.lifecycle import Lifecycle

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    t0 = time.perf_counter()
    state = _build_gpt(args, saver)
    out: dict[str, Any] = {"model": {"params": state["params"], "optimizer_flat_bytes": state["optimizer_flat_bytes"],
                                     "layers": args.layers, "hidden": args.hidden,
                                     "vocab": args.vocab, "build_s": time.perf_counter() - t0},
                           "strategies": {}}
    # One set of pinned buffers for both strategies' drivers.
    host = HostCopies(config=PinnedConfig(streams=args.copy_streams, chunk_bytes=args.chunk_mib << 20))
    chunks, optimizer = state["chunks"], state["optimizer"]
    for strategy in args.strategies:
        config = MegatronDriverConfig.from_megatron(
            chunks, optimizer, strategy=strategy, ci=False, verify_cycles=args.verified, optimizer_offload="driver"
        )
        timed = _TimedMemory(saver)
        driver = MegatronTrainer(chunks=chunks, optimizer=optimizer, config=config, memory=timed, host=host)
        trace_dir = Path(tempfile.mkdtemp(prefix="miles-fsm-bench-trace-"))
        lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=600), verify=config.verify,
                                                              trace_dir=trace_dir))
        lc.start()
        cycles, results = [], []
        for c in range(args.cycles):
            gpu_train_step(state, step=c + 1)
            torch.cuda.synchronize()
            check = c < args.verified
            opt_before = digest_tensors(driver.optimizer_state()) if check else None
            free_training, _ = torch.cuda.mem_get_info()
            rs, moved, free_paused, marks = {}, {}, None, {}
            log_mark, mem_mark = len(host.log), len(timed.events)
            torch.cuda.synchronize()
            for name in _CYCLE:
                mark = len(host.log)
                marks[name] = time.perf_counter()
                rs[name] = lc.fire(name)
                if name in ("pause", "sync"):
                    # Offload and wake end when the device is done: the wake's loads are
                    # queued, not awaited, by the driver.
                    torch.cuda.synchronize()
                    marks[name + "_done"] = time.perf_counter()
                moved[name] = {"save": 0, "load": 0, "memory_save": 0, "memory_load": 0}
                for rec in host.log[mark:]:
                    moved[name][rec.op] += rec.nbytes
                    if rec.key == OPTIMIZER_KEY:
                        moved[name][f"memory_{rec.op}"] += rec.nbytes
                if name == "pause":
                    torch.cuda.synchronize()
                    free_paused, _ = torch.cuda.mem_get_info()
            opt_exact = digest_tensors(driver.optimizer_state()) == opt_before if check else None
            results.append(rs)
            cycles.append(
                {
                    "epoch": lc.epoch,
                    "verified": lc.verifies(lc.epoch),
                    "optimizer_state_exact": opt_exact,
                    "freed_in_paused_bytes": (free_paused or 0) - free_training,
                    "moved": moved,
                    "alloc_s": sum(rec.alloc_s for rec in host.log if rec.key in ("actor", OPTIMIZER_KEY)),
                    "offload_wall_s": marks["pause_done"] - marks["offload"],
                    "wake_wall_s": marks["sync_done"] - marks["rematerialize"],
                    "transfers": [
                        {"key": r.key, "op": r.op, "bytes": r.nbytes, "s": r.seconds, "alloc_s": r.alloc_s,
                         "waited": r.waited, "GBps": r.gbps if r.waited else None}
                        for r in host.log[log_mark:]
                    ],
                    "memory_calls": timed.events[mem_mark:],
                }
            )
            print(f"[{strategy}] cycle {c + 1}: " + " ".join(f"{n}={rs[n].duration_s * 1e3:.0f}ms" for n in _CYCLE)
                  + f" opt_exact={opt_exact}", flush=True)
        lc.close()
        events = _trace_events(trace_dir / "rank-0.jsonl")
        for cyc, rs in zip(cycles, results):
            mv = cyc["moved"]
            cyc["transitions"] = {
                n: _transition_row(r, events.get((r.epoch, n), 0), mv[n]["memory_save"] + mv[n]["memory_load"], limits)
                for n, r in rs.items()
            }
            # What crosses PCIe: every save (D2H) in the offload, every load (H2D) in the wake.
            cyc["crossed_d2h"] = {n: mv[n]["save"] for n in _CYCLE}
            cyc["crossed_h2d"] = {n: mv[n]["load"] for n in _CYCLE}
            cyc["offload"] = _phase(cyc, _OFFLOAD, "crossed_d2h", limits["pinned"]["d2h_GBps"], cyc["offload_wall_s"])
            cyc["wake"] = _phase(cyc, _WAKE, "crossed_h2d", limits["pinned"]["h2d_GBps"], cyc["wake_wall_s"])
        out["strategies"][strategy] = {
            "cycles": cycles,
            "all_exact": all(c["optimizer_state_exact"] in (True, None) for c in cycles),
            "host_bytes": {
                "data": driver.host_bytes(),
                "optimizer_state": host.host_bytes(OPTIMIZER_KEY),
                "actor": host.host_bytes("actor"),
                "reserved": host.reserved_bytes(),
                "pinned": host.pinned_bytes(),
                "buffer_allocations": host.allocations,
            },
            "state": lc.state.value,
        }
    tensors = dict(driver.tensors())
    out["verification"] = verification_bench(tensors, threads=default_threads(), sync=torch.cuda.synchronize)
    opt = driver.optimizer_state()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    digest_tensors(opt)
    s = time.perf_counter() - t0
    nbytes = sum(t.numel() for t in opt.values())
    out["verification_optimizer_state"] = {"bytes": nbytes, "tensors": len(opt), "s": s, "GBps": nbytes / s / 1e9}
    from miles_fsm.digest import StagingRing

    out["verification"]["staging_pinned_bytes"] = StagingRing.for_device(torch.device("cuda", 0)).pinned_bytes
    out["wake_load"] = wake_load_limit(saver, host, opt)
    dist.destroy_process_group()
    return out


# ================================================================ summary


def wake_load_limit(saver: Any, host: Any, state: Mapping[str, Any], repeats: int = 2) -> dict[str, Any]:
    """The H2D limit that applies to a wake: the optimizer state's load alone, right after the
    three trainer tags are mapped again, and the same load 60 ms after the mapping.

    On an H200 the driver's own work on freshly mapped memory slows copy-engine
    H2D for about 50 ms (``benchmarks/gpu_copy_paths.py``); a wake cannot wait
    that out, so this is the rate its data path can reach. Run last: the
    param and grad buffers come back with undefined contents.
    """
    import torch

    from miles_fsm.drivers.megatron import OPTIMIZER_KEY
    from miles_fsm.states import TRAINER_TAGS

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.cuda.synchronize()
    host.save(OPTIMIZER_KEY, state)
    out: dict[str, Any] = {"bytes": nbytes, "tags": list(TRAINER_TAGS)}
    for label, idle_s in (("just_mapped", 0.0), ("mapped_60ms_before", 0.06)):
        runs = []
        for _ in range(repeats):
            for tag in TRAINER_TAGS:
                saver.pause(tag)
            for tag in TRAINER_TAGS:
                saver.resume(tag)
            time.sleep(idle_s)
            t0 = time.perf_counter()
            host.load(OPTIMIZER_KEY, state)
            runs.append(time.perf_counter() - t0)
        out[label] = {"runs_s": runs, "GBps": nbytes / min(runs) / 1e9}
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios docs/benchmarks.md quotes: steady cycles (after the verified ones) for the data path."""
    summary: dict[str, Any] = {}
    for strategy, data in result["run"]["strategies"].items():
        cycles = data["cycles"]
        steady = [c for c in cycles if not c["verified"]] or cycles[1:] or cycles
        entry: dict[str, Any] = {}
        for phase in ("offload", "wake"):
            vals = [c[phase] for c in steady]
            entry[phase] = {
                "median_s": statistics.median(v["data_path_s"] for v in vals),
                "bytes": vals[-1]["host_bytes_crossed"],
                "median_GBps": statistics.median(v["GBps"] for v in vals if v["GBps"] is not None)
                if any(v["GBps"] for v in vals) else None,
                "limit_GBps": vals[-1]["limit_GBps"],
            }
            g, lim = entry[phase]["median_GBps"], entry[phase]["limit_GBps"]
            entry[phase]["vs_limit"] = g / lim if g and lim else None
            entry[phase]["first_cycle_s"] = cycles[0][phase]["data_path_s"]
        fractions = {
            n: max(c["transitions"][n]["guard_trace_fraction"] for c in steady) for n in _CYCLE
        }
        entry["max_guard_trace_fraction"] = fractions
        entry["transitions_median_s"] = {n: statistics.median(c["transitions"][n]["s"] for c in steady) for n in _CYCLE}
        entry["host_bytes"] = data["host_bytes"]
        summary[strategy] = entry
    v = result["run"]["verification"]
    summary["verification"] = {k: v[k] for k in ("bytes", "pipelined_GBps", "naive_per_tensor_GBps",
                                                 "threaded_per_tensor_GBps", "speedup_vs_naive", "stable")}
    if "demo" in result:
        summary["demo_max_guard_trace_fraction"] = {
            label: {t: row["max_guard_trace_fraction"] for t, row in d["transitions"].items()}
            for label, d in result["demo"].items()
        }
    return summary


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    result: dict[str, Any] = {
        "benchmark": "lifecycle",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": "cuda" if cuda else "cpu",
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "megatron_core": _version("megatron-core"),
            "torch_memory_saver": _version("torch-memory-saver"),
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("run", "out", "_parser")},
    }
    limits: dict[str, Any] = {
        "sha256_core_GBps": sha256_core_GBps(),
        "trace_event_us": trace_event_us(),
        "gloo": gloo_latency(),
        "host_copy_GBps": host_copy_GBps(),
    }
    limits["sha256_all_cores_GBps"] = limits["sha256_core_GBps"] * min(16, os.cpu_count() or 1)
    print(f"limits: sha256 {limits['sha256_core_GBps']:.2f} GB/s/core, trace {limits['trace_event_us']:.1f} us/event, "
          f"gloo all-reduce {limits['gloo']['allreduce_us']:.0f} us, guard {limits['gloo']['guard_us']:.0f} us",
          flush=True)
    if cuda:
        limits["pinned"] = pinned_limits()
        limits["device_copy_GBps"] = device_copy_GBps()
        print(f"pinned H2D {limits['pinned']['h2d_GBps']:.1f} GB/s, D2H {limits['pinned']['d2h_GBps']:.1f} GB/s, "
              f"device copy {limits['device_copy_GBps']:.0f} GB/s", flush=True)
        result["limits"] = limits
        result["run"] = run_gpu(args, limits)
    else:
        limits["pinned"] = None  # no PCIe here: the host memcpy rate is the limit
        result["limits"] = limits
        result["run"] = run_cpu(args, limits)
        if not args.no_demo:
            result["demo"] = demo_overhead(limits)
    result["summary"] = summarize(result)
    return result


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench-out/lifecycle.json"), help="the JSON file to write")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--strategies", nargs="+", default=["rematerialize", "backup"])
    p.add_argument("--cycles", type=int, default=4, help="lifecycle cycles per strategy (default 4)")
    p.add_argument("--verified", type=int, default=2, help="cycles verified by SHA256 from the start (default 2)")
    p.add_argument("--no-demo", action="store_true", help="CPU: skip the demo overhead measurement")
    g = p.add_argument_group("CUDA model (megatron GPT)")
    g.add_argument("--layers", type=int, default=28)
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--vocab", type=int, default=50304)
    g.add_argument("--seq", type=int, default=512)
    g.add_argument("--batch", type=int, default=2)
    g.add_argument("--copy-streams", type=int, default=2, help="CUDA streams the host copies rotate over")
    g.add_argument("--chunk-mib", type=int, default=64, help="size of one host copy chunk, MiB")
    c = p.add_argument_group("CPU model (reference trainer)")
    c.add_argument("--cpu-dim", type=int, default=512)
    c.add_argument("--cpu-layers", type=int, default=8)
    c.add_argument("--cpu-vocab", type=int, default=8192)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="offload/wake and verification against the measured hardware limits; writes one JSON file",
        description=(__doc__ or "").split("\n\n")[0],
    )
    _arguments(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result["summary"], indent=2, default=str))
    print(f"wrote {args.out}", flush=True)
    if result["device"] == "cuda":
        # torch_memory_saver's torch hook can exit(1) while the interpreter frees region
        # tensors at shutdown (gpu-facts); the results are written, so skip that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_lifecycle", description=(__doc__ or "").split("\n\n")[0])
    _arguments(p)
    return _run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
