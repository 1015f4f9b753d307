"""Verification speed: the chunked, pipelined digest beside the per-tensor paths it replaced."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from machine import ratio_spread, spread


def _naive_digests(tensors: Mapping[str, Any]) -> dict[str, str]:
    """The baseline: per tensor, ``.cpu()`` then one hashlib SHA256, one after another."""
    import torch

    out = {}
    for name, t in tensors.items():
        host = t.detach().cpu().contiguous()
        out[name] = hashlib.sha256(host.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def _threaded_per_tensor(tensors: Mapping[str, Any], threads: int) -> dict[str, str]:
    """The previous miles_fsm.digest: one plain SHA256 per tensor (``.to('cpu')`` each), on a thread pool."""
    from miles_fsm.digest import tensor_sha256

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(tensors, pool.map(tensor_sha256, tensors.values())))


def verification_bench(tensors: Mapping[str, Any], *, threads: int, sync: Any, rounds: int = 3) -> dict[str, Any]:
    """The digest paths over the same tensors, timed in the same run, each treated alike: the host
    pipeline (staging ring + every core), the per-tensor paths it replaced, and, for CUDA tensors
    where Triton is installed, the device digest (``miles_fsm.digest_device``).

    Every path gets one untimed warm-up run, then ``rounds`` timed runs; in
    each round every path runs once, in an order that rotates from round to
    round. A path's figure is its median; each ratio is per round.
    """
    from miles_fsm import digest_device
    from miles_fsm.digest import DIGEST_SCHEME, digest_tensors, start_digests, tensor_digest

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    first = next(iter(tensors))
    t0 = time.perf_counter()
    digest_tensors({first: tensors[first]}, threads=threads, on_device=False)  # the staging ring, once a process
    warm_s = time.perf_counter() - t0
    out: dict[str, Any] = {"scheme": DIGEST_SCHEME, "bytes": nbytes, "tensors": len(tensors), "threads": threads,
                           "first_call_setup_s": warm_s, "rounds": rounds}
    paths = {
        "pipelined": lambda: digest_tensors(tensors, threads=threads, on_device=False),
        "naive_per_tensor": lambda: _naive_digests(tensors),
        "threaded_per_tensor": lambda: _threaded_per_tensor(tensors, threads),
    }
    on_gpu = digest_device.available() and tensors[first].device.type == "cuda"
    if on_gpu:
        paths["device"] = lambda: digest_tensors(tensors, threads=threads, on_device=True)
    results = {name: fn() for name, fn in paths.items()}  # the warm-up, alike for every path
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    stable = True
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            result = paths[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            stable = stable and result == results[name]
    out["stable"] = stable
    for name in paths:
        out[f"{name}_s"] = spread(times[name])["median"]
        out[f"{name}_GBps"] = nbytes / out[f"{name}_s"] / 1e9
    out["per_round_s"] = {name: spread(ts) for name, ts in times.items()}
    out["speedup_vs_naive_per_round"] = ratio_spread(times["naive_per_tensor"], times["pipelined"])
    out["speedup_vs_threaded_per_round"] = ratio_spread(times["threaded_per_tensor"], times["pipelined"])
    out["speedup_vs_naive"] = out["speedup_vs_naive_per_round"]["median"]
    out["speedup_vs_threaded"] = out["speedup_vs_threaded_per_round"]["median"]
    if on_gpu:
        out["device_vs_pipelined_per_round"] = ratio_spread(times["pipelined"], times["device"])
        out["device_vs_pipelined"] = out["device_vs_pipelined_per_round"]["median"]
        out["device_matches_pipelined"] = results["device"] == results["pipelined"]
        # The host's part of the device path: until start_digests returns (the table, the launch).
        launched = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            pending = start_digests(tensors, threads=threads, on_device=True)
            launched.append(time.perf_counter() - t0)
            pending.result()
        out["device_launch_s"] = spread(launched)["median"]
    # The pipelined (device) path must give the definition's digest, computed here on the host.
    largest = max(tensors, key=lambda n: tensors[n].numel() * tensors[n].element_size())
    sample = list(dict.fromkeys([*list(tensors)[:3], largest]))
    out["matches_host_definition"] = all(
        tensor_digest(tensors[n].detach().cpu()) == results["pipelined"][n] for n in sample
    )
    return out
