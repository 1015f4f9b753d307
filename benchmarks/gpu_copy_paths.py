"""Where host<->device copies lose bandwidth: host memory kind x device memory kind x copy pattern.

Issue 8's wake (H2D into torch_memory_saver memory that was just mapped
again) ran at 0.92x of the pinned H2D limit while the offload's D2H ran at
1.00x. This probe separates the candidate causes, each measured in one run:

- host memory: torch's pinned allocator (``cudaHostAlloc``), an ordinary
  allocation registered with ``cudaHostRegister`` (what ``HostCopies`` used),
  the same backed by transparent huge pages (``MADV_HUGEPAGE``);
- device memory: ``cudaMalloc`` (torch's allocator), a torch_memory_saver
  region that stays mapped, and the same region paused and resumed right
  before each copy (fresh physical pages, as in a wake);
- copy pattern: one ``copy_`` of the whole buffer, and ``HostCopies``'s
  chunked copies (64 MiB on two streams, 256 MiB on one);
- size: the whole buffer (default 16 GiB) and its first 2 GiB, the size of
  ``miles-fsm bench``'s limit measurement.

Then, after a remap: what the first H2D waits for (idle time, a kernel, a
small copy), an SM kernel reading the host buffer instead of the copy
engines, a fresh ``cudaMalloc``, and whether another tag can be unmapped
while a D2H is in flight. ``--wake`` runs only a wake in miniature (three
tags mapped again, then one ``HostCopies.load``).

Every figure is the best and the median of ``--repeats`` runs, in GB/s,
host clock around a device synchronize. Usage (CUDA, torch-memory-saver)::

    python benchmarks/gpu_copy_paths.py --out /tmp/copy_paths.json
    python benchmarks/gpu_copy_paths.py --skip-matrix --hosts registered_huge --out /tmp/after_remap.json
    python benchmarks/gpu_copy_paths.py --wake --out /tmp/wake.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_fsm.drivers.pinned import ChunkedCopier, HostCopies, host_buffer

GiB = 1 << 30
PATTERNS = {"whole": None, "64MiBx2": (64 << 20, 2), "256MiBx1": (256 << 20, 1)}


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def _timed(fn: Callable[[], None], before: Callable[[], None], repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return {"best_s": min(runs), "median_s": statistics.median(runs)}


def _copy(dst: torch.Tensor, src: torch.Tensor, pattern: str, streams: dict[int, list[torch.cuda.Stream]]) -> None:
    spec = PATTERNS[pattern]
    if spec is None:
        dst.copy_(src, non_blocking=True)
        return
    chunk, n = spec
    ChunkedCopier(streams[n], chunk).copy([(dst, src)])
    current = torch.cuda.current_stream()
    for s in streams[n]:
        current.wait_stream(s)


def _after_remap(saver: Any, region: torch.Tensor, host: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """What the first H2D after a remap waits for: a fixed cost, or one that time or other work absorbs.

    Each case pauses and resumes the region, does something, then times one
    whole H2D of the region (and, separately, the something).
    """
    nbytes = region.numel()
    probe = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    rows = []

    def case(name: str, between: Callable[[], None], size: int = nbytes) -> None:
        for _ in range(repeats):
            saver.pause("probe")
            saver.resume("probe")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            between()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            region[:size].copy_(host[:size], non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rows.append({"case": name, "between_s": t1 - t0, "h2d_s": t2 - t1, "bytes": size,
                         "h2d_GBps": size / (t2 - t1) / 1e9})
        last = rows[-1]
        print(f"after remap, {name:28s}: between {last['between_s'] * 1e3:7.1f} ms, "
              f"H2D {last['bytes'] / GiB:4.0f} GiB {last['h2d_s'] * 1e3:7.1f} ms ({last['h2d_GBps']:.2f} GB/s)",
              flush=True)

    def nothing() -> None:
        pass

    case("nothing", nothing)
    case("nothing, 64 MiB copy", nothing, 64 << 20)
    case("sleep 50 ms", lambda: time.sleep(0.05))
    case("sleep 200 ms", lambda: time.sleep(0.2))
    case("64 MiB D2H", lambda: probe.copy_(region[: 64 << 20]))
    case("64 MiB device copy in", lambda: region[: 64 << 20].copy_(probe))
    case("fill_ whole region (kernel)", lambda: region.fill_(3))
    case("H2D 64 MiB first", lambda: region[: 64 << 20].copy_(host[: 64 << 20], non_blocking=True))
    rows.extend(_kernel_h2d(saver, region, host, repeats))
    rows.extend(_fresh_cudamalloc(host[:nbytes], repeats))
    rows.extend(_unmap_during_copy(saver, region, host, repeats))
    return rows


class _HostMapped:
    """A registered host buffer as a CUDA array (its UVA address), so a kernel can read it over PCIe."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": (host.numel() // 4,), "typestr": "<i4", "data": (host.data_ptr(), False), "version": 3,
        }


def _kernel_h2d(saver: Any, region: torch.Tensor, host: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """H2D done by an SM kernel reading host memory (zero-copy), not by the copy engine."""
    src = torch.as_tensor(_HostMapped(host), device="cuda")
    dst = region.view(torch.int32)
    pattern = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    host[: 64 << 20].copy_(pattern)
    host[-(64 << 20) :].copy_(pattern)
    rows = []

    def kernel(lo: int, hi: int) -> None:
        torch.bitwise_or(src[lo // 4 : hi // 4], 0, out=dst[lo // 4 : hi // 4])

    nbytes = region.numel()
    split = 2 * GiB
    for name, remap, parts in (
        ("kernel, mapped", False, "kernel"),
        ("kernel, after remap", True, "kernel"),
        ("kernel 2 GiB + CE rest, after remap", True, "split"),
    ):
        for _ in range(repeats):
            if remap:
                saver.pause("probe")
                saver.resume("probe")
            region[: 64 << 20].zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if parts == "kernel":
                kernel(0, nbytes)
            else:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    region[split:].copy_(host[split:], non_blocking=True)
                kernel(0, split)
                torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            exact = torch.equal(region[: 64 << 20].cpu(), pattern) and torch.equal(region[-(64 << 20) :].cpu(), pattern)
            rows.append({"case": name, "h2d_s": s, "bytes": nbytes, "h2d_GBps": nbytes / s / 1e9, "exact": exact})
        print(f"{name:36s}: {rows[-1]['h2d_s'] * 1e3:7.1f} ms ({rows[-1]['h2d_GBps']:.2f} GB/s) exact={exact}",
              flush=True)
    return rows


def _fresh_cudamalloc(host: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """Does fresh memory from cudaMalloc (torch's cache emptied) pay the same first-write cost?"""
    rows = []
    for _ in range(repeats):
        torch.cuda.empty_cache()
        dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        rows.append({"case": "fresh cudaMalloc", "between_s": 0.0, "h2d_s": s, "bytes": host.numel(),
                     "h2d_GBps": host.numel() / s / 1e9})
        del dev
    print(f"fresh cudaMalloc: H2D {rows[-1]['h2d_s'] * 1e3:.1f} ms ({rows[-1]['h2d_GBps']:.2f} GB/s)", flush=True)
    return rows


def _unmap_during_copy(saver: Any, region: torch.Tensor, host: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """Can another tag be unmapped while a D2H of this one is in flight, or does the unmap wait for it?

    Calls the library's pause directly (the saver's own pause synchronizes the device first).
    """
    from torch_memory_saver import torch_memory_saver as tms

    other = saver.empty("probe_other", 4 * GiB, torch.uint8)
    stream = torch.cuda.Stream()
    rows = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(region, non_blocking=True)
        t1 = time.perf_counter()
        tms.pause("probe_other")
        t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        tms.resume("probe_other")
        rows.append({"case": "unmap 4 GiB during a 16 GiB D2H", "queue_s": t1 - t0, "unmap_s": t2 - t1,
                     "d2h_done_s": t3 - t0, "bytes": region.numel()})
        print(f"unmap during D2H: unmap {rows[-1]['unmap_s'] * 1e3:.1f} ms, D2H done after "
              f"{rows[-1]['d2h_done_s'] * 1e3:.1f} ms", flush=True)
    del other
    return rows


def _wake_loads(repeats: int) -> list[dict[str, Any]]:
    """A wake in miniature: three tags mapped again (3, 6, 18 GiB, the shapes of param, grad and
    optimizer memory of issue 8's GPT), then ``HostCopies.load`` of the 18 GiB: at once, 60 ms later,
    and with only the 18 GiB mapped again.

    (At commit f5e3c9b this also ran loads staged through a device buffer that stays
    mapped: 414.1 ms against 411.4 ms direct, so staging was dropped.)"""

    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    tags = {"wake_param": 3 * GiB, "wake_grad": 6 * GiB, "wake_opt": 18 * GiB}
    regions = {t: saver.empty(t, n, torch.uint8) for t, n in tags.items()}
    opt = regions["wake_opt"]
    opt.copy_(torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda").repeat(opt.numel() >> 26))
    host = HostCopies()
    host.save("opt", {"opt": opt})
    want = [opt[: 64 << 20].cpu(), opt[-(64 << 20) :].cpu()]
    rows = []
    full = opt.numel()
    cases = [("direct", 0.0), ("sleep 60 ms, direct", 0.06), ("only opt remapped, direct", -1.0)]
    for name, sleep in cases:
        remapped = ["wake_opt"] if sleep < 0 else list(tags)
        for _ in range(repeats):
            for t in remapped:
                saver.pause(t)
            t0 = time.perf_counter()
            for t in remapped:
                saver.resume(t)
            t1 = time.perf_counter()
            time.sleep(max(sleep, 0.0))
            t2 = time.perf_counter()
            host.load("opt", {"opt": opt})
            t3 = time.perf_counter()
            exact = torch.equal(opt[: 64 << 20].cpu(), want[0]) and torch.equal(opt[-(64 << 20) :].cpu(), want[1])
            rows.append({"case": name, "sleep_s": max(sleep, 0.0), "remapped": remapped,
                         "resume_s": t1 - t0, "load_s": t3 - t2, "bytes": full,
                         "load_GBps": full / (t3 - t2) / 1e9, "exact": exact})
        r = rows[-1]
        print(f"{name:30s}: resume {r['resume_s'] * 1e3:.1f} ms, load {r['load_s'] * 1e3:.1f} ms "
              f"({r['load_GBps']:.2f} GB/s) exact={r['exact']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hosts", nargs="+", default=["cudaHostAlloc", "registered", "registered_huge"])
    p.add_argument("--skip-matrix", action="store_true", help="only the after-remap cases")
    p.add_argument("--wake", action="store_true",
                   help="only the wake-like loads (three tags mapped again, then one load)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

    nbytes = args.gib * GiB
    small = 2 * GiB
    torch.cuda.set_device(0)
    if args.wake:
        result = {"benchmark": "gpu_copy_paths/wake", "device": torch.cuda.get_device_name(0),
                  "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": _wake_loads(args.repeats)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        return 0
    out: dict[str, Any] = {
        "benchmark": "gpu_copy_paths",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": torch.get_num_threads()},
        "bytes": nbytes,
        "thp": _thp_setting(),
        "host_alloc_s": {},
        "anon_huge_pages_bytes": {},
        "rows": [],
    }
    hosts: dict[str, torch.Tensor] = {}
    keep = []
    for kind in args.hosts:
        huge0 = _meminfo("AnonHugePages")
        t0 = time.perf_counter()
        if kind == "cudaHostAlloc":
            hosts[kind] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            buf, registered, fin = host_buffer(nbytes, pin=True, huge_pages=kind == "registered_huge")
            if not registered:
                raise SystemExit(f"cudaHostRegister refused {kind}")
            hosts[kind] = buf
            keep.append(fin)
        out["host_alloc_s"][kind] = time.perf_counter() - t0
        out["anon_huge_pages_bytes"][kind] = _meminfo("AnonHugePages") - huge0
        hosts[kind].fill_(7)
        print(f"host {kind}: {out['host_alloc_s'][kind]:.2f} s, "
              f"+{out['anon_huge_pages_bytes'][kind] / GiB:.1f} GiB AnonHugePages", flush=True)

    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    region = saver.empty("probe", nbytes, torch.uint8)
    plain = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    plain.fill_(1)

    def remap() -> None:
        saver.pause("probe")
        saver.resume("probe")

    def nothing() -> None:
        pass

    devices = {"cudaMalloc": (plain, nothing), "tms_mapped": (region, nothing), "tms_remapped": (region, remap)}
    streams = {n: [torch.cuda.Stream() for _ in range(n)] for n in (1, 2)}
    # Warm-up: contexts, streams, the first copies of each pair.
    for host in hosts.values():
        _copy(plain[:small], host[:small], "64MiBx2", streams)
    torch.cuda.synchronize()
    remap_s = _timed(remap, nothing, args.repeats)
    out["remap_s"] = remap_s
    for hkind, host in ({} if args.skip_matrix else hosts).items():
        for dkind, (dev, before) in devices.items():
            for pattern in PATTERNS:
                for direction in ("h2d", "d2h"):
                    for size in (nbytes, small):
                        if size == small and pattern != "whole":
                            continue
                        d, s = (dev[:size], host[:size]) if direction == "h2d" else (host[:size], dev[:size])
                        t = _timed(lambda d=d, s=s, pat=pattern: _copy(d, s, pat, streams), before, args.repeats)
                        row = {"host": hkind, "device": dkind, "pattern": pattern, "direction": direction,
                               "bytes": size, **t, "best_GBps": size / t["best_s"] / 1e9,
                               "median_GBps": size / t["median_s"] / 1e9}
                        out["rows"].append(row)
                        print(f"{hkind:15s} {dkind:12s} {pattern:8s} {direction} {size / GiB:4.0f} GiB "
                              f"best {row['best_GBps']:6.2f} median {row['median_GBps']:6.2f} GB/s", flush=True)
    out["after_remap"] = _after_remap(saver, region, hosts[args.hosts[-1]], args.repeats)
    del keep
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # the JSON is written by then
