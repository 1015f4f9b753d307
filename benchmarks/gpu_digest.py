"""SHA-256 on the device against the device-copy limit and the host pipeline, in one run (issue 27).

Over ``--gib`` GiB of bf16 tensors shaped like a transformer's (embedding,
qkv, projections, MLP, norms), on one CUDA device:

- the device digest (``miles_fsm.digest_device``: one Triton lane per
  chunk) for each ``--chunks-kib`` chunk size, timed with the per-tensor
  roots hashed on the host as ``digest_tensors`` does; then each
  ``--launch`` lanes/warps shape at the scheme's chunk size;
- ``digest_tensors`` as verification calls it, on the device and through
  the host pipeline (pinned staging ring + every host core), under each
  scheme, and whether all paths give the same digests;
- the device-copy limit: one D2D copy of the same bytes, bytes read per s.

The bar (issue 27): the device digest at >= 20x the host pipeline, or at
>= 15% of the device-copy limit, whichever is higher. Run unattended:

    python benchmarks/gpu_digest.py --out bench-out/gpu_digest.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine import describe_machine, spread

GiB = 1 << 30


def _progress(msg: str) -> None:
    print(f"[gpu_digest] {msg}", flush=True)


def model_tensors(gib: float, hidden: int = 4096, ffn: int = 14336, vocab: int = 151936) -> dict[str, Any]:
    """bf16 tensors with random bits, shaped like a decoder's layers, about ``gib`` GiB in all."""
    import torch

    def make(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_()
        return t

    out = {"embed": make(vocab, hidden)}
    layer = 0
    while sum(t.numel() * 2 for t in out.values()) < gib * GiB:
        p = f"layers.{layer}."
        out.update({p + "qkv": make(hidden + 2 * (hidden // 4), hidden), p + "proj": make(hidden, hidden),
                    p + "fc1": make(2 * ffn, hidden), p + "fc2": make(hidden, ffn),
                    p + "norm1": make(hidden), p + "norm2": make(hidden), p + "bias": make(hidden + 8)})  # fmt: skip
        layer += 1
    out["final_norm"] = make(hidden)
    return out


def timed(fn: Callable[[], Any], rounds: int) -> tuple[Any, dict[str, Any]]:
    """One untimed warm-up (compiles, allocates), then ``rounds`` timed calls; the last result and the spread."""
    import torch

    result = fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return result, spread(times)


def device_copy(nbytes: int, rounds: int) -> dict[str, Any]:
    """The device-copy limit over ``nbytes``: one D2D copy, bytes read (= written) per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    bufs = [src, torch.empty_like(src)]
    del src
    _, s = timed(lambda: bufs[1].copy_(bufs[0]), rounds)
    bufs.clear()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "s": s, "GBps": nbytes / s["median"] / 1e9}


def sweep(tensors: dict[str, Any], chunks_kib: list[int], launches: list[tuple[int, int, int | None]], scheme_chunk: int,
          rounds: int, nbytes: int) -> dict[str, Any]:  # fmt: skip
    """Device digest GB/s per chunk size (default launch shape), then per launch shape (scheme's chunk)."""
    from miles_fsm import digest_device

    ts = list(tensors.values())

    def run(chunk: int, lanes: int, warps: int, maxnreg: int | None = None) -> Callable[[], list[str]]:
        def go() -> list[str]:
            leaves = digest_device.chunk_digests(ts, chunk, lanes=lanes, num_warps=warps, maxnreg=maxnreg)
            return [hashlib.sha256(j).hexdigest() for j in leaves]  # the roots' cost, as digest_tensors pays it

        return go

    rows: list[dict[str, Any]] = []
    for kib in chunks_kib:
        _, s = timed(run(kib << 10, digest_device.LANES, digest_device.NUM_WARPS), rounds)
        rows.append({"chunk_kib": kib, "lanes": digest_device.LANES, "warps": digest_device.NUM_WARPS,
                     "chunks": -(-nbytes // (kib << 10)), "s": s, "GBps": nbytes / s["median"] / 1e9})  # fmt: skip
        _progress(f"device digest, {kib} KiB chunks: {rows[-1]['GBps']:.0f} GB/s ({rows[-1]['chunks']} chunks)")
    for lanes, warps, maxnreg in launches:
        t0 = time.perf_counter()
        run(scheme_chunk, lanes, warps, maxnreg)()  # the compile for this shape
        compile_s = time.perf_counter() - t0
        _, s = timed(run(scheme_chunk, lanes, warps, maxnreg), rounds)
        rows.append({"chunk_kib": scheme_chunk >> 10, "lanes": lanes, "warps": warps, "maxnreg": maxnreg,
                     "first_call_s": compile_s, "chunks": -(-nbytes // scheme_chunk), "s": s,
                     "GBps": nbytes / s["median"] / 1e9})  # fmt: skip
        _progress(f"device digest, {lanes} lanes x {warps} warps, maxnreg {maxnreg}: {rows[-1]['GBps']:.0f} GB/s")
    return {"rows": rows}


def paths(tensors: dict[str, Any], rounds: int, nbytes: int) -> dict[str, Any]:
    """digest_tensors on the device and through the host pipeline, per scheme, and their agreement."""
    from miles_fsm.digest import SCHEMES, default_threads, digest_tensors

    out: dict[str, Any] = {"threads": default_threads()}
    for scheme in SCHEMES:
        row: dict[str, Any] = {"chunk_bytes": SCHEMES[scheme]}
        got = {}
        for label, on_device in (("device", True), ("host_pipeline", False)):
            got[label], s = timed(lambda d=on_device, sc=scheme: digest_tensors(tensors, scheme=sc, on_device=d),
                                  rounds)
            row[label] = {"s": s, "GBps": nbytes / s["median"] / 1e9}
            _progress(f"{scheme}, {label}: {row[label]['GBps']:.1f} GB/s")
        row["device_vs_host_pipeline"] = row["device"]["GBps"] / row["host_pipeline"]["GBps"]
        row["same_digests"] = got["device"] == got["host_pipeline"]
        out[scheme] = row
    return out


def _launch(text: str) -> tuple[int, int, int | None]:
    """"128x4" -> (128, 4, None); "128x4r128" -> (128, 4, 128)."""
    shape, _, reg = text.partition("r")
    lanes, warps = (int(x) for x in shape.split("x"))
    return lanes, warps, int(reg) if reg else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gib", type=float, default=8.0, help="bytes of bf16 tensors to hash, GiB (default 8)")
    p.add_argument("--chunks-kib", type=int, nargs="+", default=[16, 32, 64, 128, 256, 1024, 4096])
    p.add_argument("--launch", nargs="+", default=["64x2", "256x8", "256x4", "128x4r128", "256x8r128"],
                   help="lanes x warps per program (rN: at most N registers a thread) to try at the scheme's "
                        "chunk size, beside the default 128x4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_digest needs a CUDA device (and Triton); none is visible here", file=sys.stderr)
        return 2
    from miles_fsm import digest_device
    from miles_fsm.digest import DIGEST_SCHEME, SCHEMES

    if not digest_device.available():
        print("gpu_digest needs Triton (`pip install triton`): the device digest is a Triton kernel", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    _progress("describing the machine (SHA256 and write anchors)")
    result: dict[str, Any] = {"benchmark": "gpu_digest", "machine": describe_machine(), "args": vars(args) | {
        "out": str(args.out)}, "gpu": torch.cuda.get_device_name(0), "scheme": DIGEST_SCHEME}
    launches = [_launch(s) for s in args.launch]
    _progress(f"making {args.gib:g} GiB of bf16 tensors")
    tensors = model_tensors(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    result["tensors"] = {"count": len(tensors), "bytes": nbytes}
    t0 = time.perf_counter()
    digest_device.chunk_digests([tensors["final_norm"]], SCHEMES[DIGEST_SCHEME])
    result["first_call_s"] = time.perf_counter() - t0  # Triton's compile (or its disk cache)
    _progress(f"kernel ready in {result['first_call_s']:.1f} s; device copy limit")
    result["device_copy"] = device_copy(nbytes, args.rounds)
    _progress(f"device copy: {result['device_copy']['GBps']:.0f} GB/s")
    result["sweep"] = sweep(tensors, args.chunks_kib, launches, SCHEMES[DIGEST_SCHEME], args.rounds, nbytes)
    result["paths"] = paths(tensors, args.rounds, nbytes)
    default = result["paths"][DIGEST_SCHEME]
    device, host, copy = default["device"]["GBps"], default["host_pipeline"]["GBps"], result["device_copy"]["GBps"]
    bar = max(20 * host, 0.15 * copy)
    best = max(result["sweep"]["rows"], key=lambda r: r["GBps"])
    result["summary"] = {
        "scheme": DIGEST_SCHEME, "device_GBps": device, "host_pipeline_GBps": host, "device_copy_GBps": copy,
        "device_vs_host_pipeline": device / host, "device_vs_copy_limit": device / copy,
        "bar_GBps": bar, "meets_bar": device >= bar, "same_digests": all(
            result["paths"][s]["same_digests"] for s in SCHEMES),
        "best_sweep": {k: best.get(k) for k in ("chunk_kib", "lanes", "warps", "maxnreg", "GBps")},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    s = result["summary"]
    _progress(f"{DIGEST_SCHEME}: device {device:.0f} GB/s = {s['device_vs_host_pipeline']:.1f}x the host pipeline "
              f"({host:.1f} GB/s), {s['device_vs_copy_limit']:.1%} of the copy limit ({copy:.0f} GB/s); "
              f"bar {bar:.0f} GB/s: {'met' if s['meets_bar'] else 'NOT met'}; same digests: {s['same_digests']}")
    _progress(f"wrote {args.out}")
    return 0 if s["same_digests"] else 1


if __name__ == "__main__":
    sys.exit(main())
