"""SHA256 of many tensors, in parallel.

hashlib releases the GIL on buffers over 2 KiB, so a thread pool scales with
host cores. Tensors are hashed in place through a zero-copy ctypes view; a
device tensor is copied to host first.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["digest_tensors", "tensor_sha256"]


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA256 of a tensor's bytes, in its own dtype and row-major order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    h = hashlib.sha256()
    if nbytes:
        h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    return h.hexdigest()


def default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def digest_tensors(tensors: Mapping[str, torch.Tensor], *, threads: int | None = None) -> dict[str, str]:
    """SHA256 of each named tensor, hashed on ``threads`` threads."""
    n = threads or default_threads()
    if n == 1 or len(tensors) < 2:
        return {name: tensor_sha256(t) for name, t in tensors.items()}
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="miles-fsm-sha") as pool:
        return dict(zip(tensors.keys(), pool.map(tensor_sha256, tensors.values())))
