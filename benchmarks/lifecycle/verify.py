"""Verification speed: the chunked, pipelined digest beside the per-tensor paths it replaced."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any


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


def verification_bench(tensors: Mapping[str, Any], *, threads: int, sync: Any) -> dict[str, Any]:
    """The three digest paths over the same tensors, timed in the same run."""
    from miles_fsm.digest import DIGEST_SCHEME, digest_tensors, tensor_digest

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
    largest = max(tensors, key=lambda n: tensors[n].numel() * tensors[n].element_size())
    sample = list(dict.fromkeys([*list(tensors)[:3], largest]))
    out["matches_host_definition"] = all(
        tensor_digest(tensors[n].detach().cpu()) == runs["pipelined"][1][n] for n in sample
    )
    return out
