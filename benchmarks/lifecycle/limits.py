"""The hardware limits each phase is compared with, measured in the same run as the phases."""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from machine import sha256_core_MBps

GiB = 1 << 30


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
    """hashlib SHA256 on one core, GB/s (the machine anchor every benchmark records, in GB/s)."""
    return sha256_core_MBps(nbytes, repeats) / 1e3


def trace_event_us(n: int = 2000) -> float:
    """The cost of one trace record (structlog + orjson + one write), microseconds."""
    from miles_fsm.trace.schema import ACTION_FINISHED
    from miles_fsm.trace.writer import Tracer

    with tempfile.TemporaryDirectory() as d:
        tracer = Tracer(d, rank=0, world=1)
        fields = {"epoch": 1, "trigger": "offload", "state": "TRAINING", "action": "backup(actor)"}
        t0 = time.perf_counter()
        for i in range(n):
            tracer.emit(ACTION_FINISHED, duration_s=0.001, bytes_moved=i, host_bytes=i, mem_before=i,
                        mem_after=i, **fields)
        per = (time.perf_counter() - t0) / n
        tracer.close()
    return per * 1e6


def _gloo_rank(ctx: Any) -> dict[str, float]:
    """All-reduce of the guard's 2 int64 on gloo, bare and through ``Guard.agree``, interleaved."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from miles_fsm import Guard
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
    from miles_fsm.launch.local import run_ranks

    outcomes = run_ranks(_gloo_rank, 2, timeout_s=120, kwargs={"iters": iters})
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"gloo latency ranks failed: {failed}")
    r = outcomes[0].result
    return {"ranks": 2, "iters": iters, **r}
