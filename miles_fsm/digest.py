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

from miles_fsm.errors import MemoryReleasedError

__all__ = ["digest_tensors", "tensor_sha256"]


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA256 of a tensor's bytes, in its own dtype and row-major order.

    Raises ``MemoryReleasedError`` for a CPU tensor whose storage was released
    (a paused region): hashing it through a raw pointer would read freed memory.
    """
    t = t.detach()
    if t.device.type == "cpu" and t.numel():
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        needed = (t.storage_offset() + extent) * t.element_size()
        if t.untyped_storage().nbytes() < needed:
            raise MemoryReleasedError(owner="verification", op="hash a tensor", tags=(), reason="its storage is released")
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
