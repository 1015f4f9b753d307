"""The bench's flags and its run: the limits, then the CPU or GPU cycles, then the ratios, in one JSON file.

Nothing here imports torch before the flags are parsed: ``miles-fsm bench --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from machine import describe_machine

from .cpu import run_cpu
from .demo import demo_overhead
from .gpu import run_gpu
from .limits import device_copy_GBps, gloo_latency, host_copy_GBps, pinned_limits, sha256_core_GBps, trace_event_us
from .report import progress, summarize, write_result

__all__ = ["DESCRIPTION", "add_arguments", "main", "run", "run_bench"]

DESCRIPTION = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
EXIT_BAD_INPUT = 2


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    result: dict[str, Any] = {
        "benchmark": "lifecycle",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": "cuda" if cuda else "cpu",
        "machine": {
            **describe_machine(),  # the anchors every benchmark JSON records
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
    progress("limits: SHA256 per core, trace event, gloo all-reduce and guard, host copy")
    limits: dict[str, Any] = {
        "sha256_core_GBps": sha256_core_GBps(),
        "trace_event_us": trace_event_us(),
        "gloo": gloo_latency(),
        "host_copy_GBps": host_copy_GBps(),
    }
    limits["sha256_all_cores_GBps"] = limits["sha256_core_GBps"] * min(16, os.cpu_count() or 1)
    progress(f"limits: sha256 {limits['sha256_core_GBps']:.2f} GB/s/core, trace {limits['trace_event_us']:.1f} us/event, "
             f"gloo all-reduce {limits['gloo']['allreduce_us']:.0f} us, guard {limits['gloo']['guard_us']:.0f} us")
    if cuda:
        limits["pinned"] = pinned_limits()
        limits["device_copy_GBps"] = device_copy_GBps()
        progress(f"pinned H2D {limits['pinned']['h2d_GBps']:.1f} GB/s, D2H {limits['pinned']['d2h_GBps']:.1f} GB/s, "
                 f"device copy {limits['device_copy_GBps']:.0f} GB/s")
        result["limits"] = limits
        result["run"] = run_gpu(args, limits)
    else:
        limits["pinned"] = None  # no PCIe here: the host memcpy rate is the limit
        result["limits"] = limits
        progress(f"CPU cycles: {', '.join(args.strategies)} x {args.cycles} cycles on 2 gloo ranks, then verification")
        t0 = time.perf_counter()
        result["run"] = run_cpu(args, limits)
        progress(f"CPU cycles done in {time.perf_counter() - t0:.0f} s")
        if not args.no_demo:
            progress("demo: guard and trace overhead in the demo's ranks")
            t0 = time.perf_counter()
            result["demo"] = demo_overhead(limits)
            progress(f"demo done in {time.perf_counter() - t0:.0f} s")
    result["summary"] = summarize(result)
    return result


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _verified(text: str) -> int | str:
    """``--verified``: a count of cycles, or ``all``."""
    return "all" if text == "all" else _at_least(0)(text)


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench-out/lifecycle.json"), help="the JSON file to write")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--strategies", nargs="+", default=["rematerialize", "backup"])
    p.add_argument("--cycles", type=_at_least(1), default=4, help="lifecycle cycles per strategy (default 4)")
    p.add_argument("--verified", type=_verified, default=2,
                   help="cycles verified by SHA256 from the start (default 2), or 'all' for every cycle")
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


def _unwritable(out: Path) -> str | None:
    """Why ``out`` cannot be written, or None: asked before the minutes of measuring, not after."""
    if out.is_dir():
        return f"--out {out} is a directory"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            with out.open("ab"):  # append mode: an earlier result stays intact until this run's is written
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}."):
                pass
    except OSError as exc:
        return f"--out {out} is not writable: {exc.strerror or exc}"
    return None


def _bad_input(args: argparse.Namespace) -> str | None:
    problem = _unwritable(args.out)
    if problem is None and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problem = "--device cuda, but torch sees no CUDA device"
    return problem


def run(args: argparse.Namespace) -> int:
    """Measure and write ``args.out``; exit code 2, before any measuring, for flags that cannot work."""
    problem = _bad_input(args)
    if problem is not None:
        sys.stderr.write(f"miles-fsm bench: {problem}\n")
        return EXIT_BAD_INPUT
    result = run_bench(args)
    write_result(result, args.out)
    if result["device"] == "cuda":
        # torch_memory_saver's torch hook can exit(1) while the interpreter frees region
        # tensors at shutdown (gpu-facts); the results are written, so skip that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_lifecycle", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
