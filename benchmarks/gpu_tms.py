"""torch_memory_saver through ``TmsMemorySaver``: freed bytes and pause/resume time per tag.

For each tag and each backup mode (none, CPU backup, CPU backup retained
between cycles) it allocates one bf16 region, then runs a few pause/resume
cycles and records:

- the device bytes freed by the pause (``torch.cuda.mem_get_info``);
- pause and resume time, device work included, and the rate in GB/s;
- that rate against the pinned host<->device copy limit, measured in the same
  run on the same sizes (pinned D2H for a pause, pinned H2D for a resume);
- whether a backed-up region came back bit-exact.

Run on a CUDA host with torch-memory-saver installed::

    python benchmarks/gpu_tms.py --out /tmp/gpu_tms_torch.json
    python benchmarks/gpu_tms.py --hook-mode preload --out /tmp/gpu_tms_preload.json

``--hook-mode preload`` re-executes itself with the wheel's preload library in
``LD_PRELOAD`` when it is not there already. JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

MODES = {
    # name: (enable_cpu_backup, retain_cpu_backup)
    "none": (False, False),
    "backup": (True, False),
    "backup_retained": (True, True),
}


def _import_tms() -> types.ModuleType:
    """``miles_fsm.drivers.tms``, installed or straight from this checkout.

    The driver needs only torch and ``miles_fsm/errors/``; when miles-fsm or
    its other dependencies are not installed (a bare GPU host), the two files
    are loaded from the checkout without running the package ``__init__``s.
    """
    try:
        return importlib.import_module("miles_fsm.drivers.tms")
    except ImportError as exc:
        print(f"miles_fsm not importable ({exc}); loading drivers/tms.py from the checkout", flush=True)
    for name in [m for m in sys.modules if m == "miles_fsm" or m.startswith("miles_fsm.")]:
        del sys.modules[name]
    root = Path(__file__).resolve().parents[1]
    for name, folder in (("miles_fsm", root / "miles_fsm"), ("miles_fsm.drivers", root / "drivers")):
        stub = types.ModuleType(name)
        stub.__path__ = [str(folder)]
        sys.modules[name] = stub
    return importlib.import_module("miles_fsm.drivers.tms")


def _parse_sizes(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        tag, _, gb = part.partition("=")
        out[tag.strip()] = float(gb)
    return out


def _ensure_preload(args: argparse.Namespace) -> None:
    """hook_mode=preload needs the library in LD_PRELOAD from process start: re-exec once."""
    if args.hook_mode != "preload":
        return
    if any("torch_memory_saver" in p for p in os.environ.get("LD_PRELOAD", "").split(":")):
        return
    if os.environ.get("_MILES_FSM_TMS_REEXEC"):
        sys.exit("LD_PRELOAD was set but the torch_memory_saver library is still missing from it")
    lib = str(_import_tms().preload_library_path())
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    env["_MILES_FSM_TMS_REEXEC"] = "1"
    print(f"re-executing with LD_PRELOAD={env['LD_PRELOAD']}", flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _pinned_limit(nbytes: int, repeats: int) -> dict[str, float]:
    """Best-of-N pinned H2D and D2H copy rate for ``nbytes``, in GB/s."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for i in range(repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t0)
        rates[f"{name}_gbps"] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # give the pinned block back; TMS pins its own backups
        torch._C._host_emptyCache()
    return rates


def _checksum(x) -> int:
    import torch

    return int(x.view(torch.int16).sum(dtype=torch.int64).item())


def _run_mode(
    saver, mode: str, sizes: dict[str, float], cycles: int, limits: dict[str, dict[str, float]]
) -> list[dict]:
    import torch

    backup, retain = MODES[mode]
    saver.set_retain_cpu_backup(retain)
    rows = []
    try:
        for base, gb in sizes.items():
            tag = f"{base}/{mode}"
            numel = int(gb * 1e9) // 2
            x = saver.empty(tag, numel, torch.bfloat16, backup=backup)
            x.uniform_(-1, 1)
            before = _checksum(x)
            nbytes = numel * 2
            per_cycle = []
            for cycle in range(cycles):
                free0, _ = torch.cuda.mem_get_info()
                pause_s = saver.timed_pause(tag)
                free1, _ = torch.cuda.mem_get_info()
                resume_s = saver.timed_resume(tag)
                free2, _ = torch.cuda.mem_get_info()
                intact = _checksum(x) == before if backup else None
                per_cycle.append(
                    {
                        "cycle": cycle + 1,
                        "freed_bytes": free1 - free0,
                        "remapped_bytes": free1 - free2,
                        "pause_s": pause_s,
                        "resume_s": resume_s,
                        "pause_gbps": nbytes / pause_s / 1e9,
                        "resume_gbps": nbytes / resume_s / 1e9,
                        "contents_intact": intact,
                        "host_bytes_after_resume": saver.host_bytes([tag]),
                    }
                )
                if backup and not intact:
                    break
            lim = limits[base]
            steady = per_cycle[1:] or per_cycle
            pause_med = statistics.median(c["pause_s"] for c in steady)
            resume_med = statistics.median(c["resume_s"] for c in steady)
            rows.append(
                {
                    "tag": base,
                    "mode": mode,
                    "bytes": nbytes,
                    "cycles": per_cycle,
                    "steady_pause_s": pause_med,
                    "steady_resume_s": resume_med,
                    # What a pinned copy of the same bytes takes, measured above.
                    "pinned_d2h_s": nbytes / (lim["d2h_gbps"] * 1e9),
                    "pinned_h2d_s": nbytes / (lim["h2d_gbps"] * 1e9),
                    "pause_vs_pinned_d2h": (nbytes / pause_med / 1e9) / lim["d2h_gbps"],
                    "resume_vs_pinned_h2d": (nbytes / resume_med / 1e9) / lim["h2d_gbps"],
                    "freed_fraction": per_cycle[0]["freed_bytes"] / nbytes,
                    "contents_intact": all(c["contents_intact"] for c in per_cycle) if backup else None,
                }
            )
            print(
                f"{tag:28s} {nbytes / 1e9:6.2f} GB  freed {per_cycle[0]['freed_bytes'] / 1e9:6.2f} GB  "
                f"pause {pause_med * 1e3:8.1f} ms ({rows[-1]['pause_vs_pinned_d2h']:.2f}x pinned)  "
                f"resume {resume_med * 1e3:8.1f} ms ({rows[-1]['resume_vs_pinned_h2d']:.2f}x pinned)  "
                f"intact={rows[-1]['contents_intact']}",
                flush=True,
            )
    finally:
        saver.set_retain_cpu_backup(False)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu_tms.json"))
    parser.add_argument("--hook-mode", choices=("torch", "preload"), default="torch")
    parser.add_argument(
        "--sizes",
        default="param_buffer=2,grad_buffer=4,default=8.6",
        help="TAG=GB,... one region per tag and mode (GB = 1e9 bytes)",
    )
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="pinned-copy repeats per size")
    args = parser.parse_args(argv)
    _ensure_preload(args)
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # stack-facts: NCCL registration can hang after a resume

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    tms = _import_tms()

    sizes = _parse_sizes(args.sizes)
    modes = [m.strip() for m in args.modes.split(",")]
    try:
        from importlib.metadata import version

        tms_version = version("torch-memory-saver")
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal for the measurement
        tms_version = f"unknown ({type(exc).__name__})"
    result: dict = {
        "benchmark": "gpu_tms",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_memory_saver": tms_version,
        "python": platform.python_version(),
        "hook_mode": args.hook_mode,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "sizes_gb": sizes,
        "cycles": args.cycles,
    }
    print(f"{result['gpu']}  torch {result['torch']}  torch_memory_saver {tms_version}  hook_mode={args.hook_mode}")

    limits = {tag: _pinned_limit(int(gb * 1e9) // 2 * 2, args.repeats) for tag, gb in sizes.items()}
    result["pinned_limit"] = limits
    for tag, lim in limits.items():
        print(f"pinned copy, {sizes[tag]:.2f} GB: H2D {lim['h2d_gbps']:.1f} GB/s  D2H {lim['d2h_gbps']:.1f} GB/s")

    saver = tms.TmsMemorySaver(config=tms.TmsConfig(hook_mode=args.hook_mode))
    result["rows"] = []
    errors = {}
    for mode in modes:
        try:
            result["rows"].extend(_run_mode(saver, mode, sizes, args.cycles, limits))
        except Exception as exc:  # noqa: BLE001 - kept in the JSON, and the exit code says it failed
            errors[mode] = f"{type(exc).__name__}: {exc}"
            print(f"mode {mode} failed: {errors[mode]}", file=sys.stderr, flush=True)
    result["errors"] = errors
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
