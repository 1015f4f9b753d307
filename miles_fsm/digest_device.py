"""Chunk digests computed where the tensors are: SHA-256 on the GPU, one lane per chunk.

``chunk_digests`` hashes every chunk of every tensor it is given in one
kernel launch (``miles_fsm.digest_kernel``, Triton, imported on first use so
that a CPU-only install never needs Triton). Only the chunk digests, 32 bytes
each, come back to the host; ``miles_fsm.digest`` ties them into each
tensor's root exactly as it does for chunks hashed on the host, so both
paths give the same digest under every scheme.

A tensor is hashed as its bytes in row-major order (``.contiguous()``
viewed as bytes): a non-contiguous view, or one whose first byte is not
16-byte aligned, is first copied on the device. The chunk table (where each
chunk starts, how long it is) is built on the device too; chunks are sorted
by length, so the lanes of one program do the same number of blocks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Sequence

import torch

from miles_fsm.errors import ConfigError

__all__ = ["LANES", "NUM_WARPS", "available", "chunk_digests"]

#: Lanes (chunks) per program, and warps per program: one lane per thread.
LANES = 128
NUM_WARPS = 4
#: The kernel reads 16-byte rows; a tensor whose bytes start elsewhere is copied first.
_ALIGN = 16


@functools.cache
@functools.cache
def _has_triton() -> bool:
    # Asked on every guarded transition (Actions.verifies): the import system is searched once a process.
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether CUDA tensors can be hashed on their device here (a CUDA device and Triton present)."""
    return torch.cuda.device_count() > 0 and _has_triton()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() and flat.data_ptr() % _ALIGN:
        flat = flat.clone()  # a fresh block from the allocator is aligned
    return flat


def chunk_digests(tensors: Sequence[torch.Tensor], chunk: int, *, lanes: int = LANES, num_warps: int = NUM_WARPS,
                  maxnreg: int | None = None) -> list[bytes]:  # fmt: skip
    """Per tensor, the SHA-256 of each ``chunk``-byte piece of its bytes, concatenated (32 bytes each).

    All tensors must be on one device: CUDA, or the host under ``TRITON_INTERPRET=1`` (the
    tests). An empty tensor has no chunk and gives ``b""``. ``lanes``, ``num_warps`` and
    ``maxnreg`` (a register cap per thread) shape the launch: benchmarks/gpu_digest.py tries them.
    """
    if chunk <= 0 or chunk % 64:
        raise ConfigError([f"chunk must be a positive multiple of 64 bytes, got {chunk}"], "chunk_digests")
    flats = [_flat_bytes(t) for t in tensors]
    live = [i for i, f in enumerate(flats) if f.numel()]
    out: list[bytes] = [b""] * len(flats)
    if not live:
        return out
    devices = {flats[i].device for i in live}
    if len(devices) != 1:
        raise ConfigError([f"pass tensors of one device, got {sorted(map(str, devices))}"], "chunk_digests")
    device = devices.pop()
    base = min((flats[i] for i in live), key=lambda f: f.data_ptr())
    sizes = [flats[i].numel() for i in live]
    counts = [-(-n // chunk) for n in sizes]
    total = sum(counts)
    table = torch.tensor([[(flats[i].data_ptr() - base.data_ptr()) // 4 for i in live], sizes, counts],
                         dtype=torch.int64).to(device)  # fmt: skip
    start_words, size_of, count_of = table[0], table[1], table[2]
    owner = torch.repeat_interleave(torch.arange(len(live), device=device), count_of, output_size=total)
    first = torch.cumsum(count_of, 0) - count_of
    k = torch.arange(total, device=device) - first[owner]
    word_off = start_words[owner] + k * (chunk // 4)
    nbytes = torch.clamp(size_of[owner] - k * chunk, max=chunk)
    order = torch.argsort(nbytes, descending=True, stable=True)
    digests = torch.empty((total, 8), dtype=torch.int32, device=device)
    kernel = importlib.import_module("miles_fsm.digest_kernel").sha256_chunks
    grid = (-(-total // lanes),)
    launch = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
    # Triton launches on the current device: make it the tensors' one.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](base, word_off[order].contiguous(), nbytes[order].contiguous(), digests, total, LANES=lanes,
                     **launch)  # fmt: skip
    in_order = torch.empty_like(digests)
    in_order[order] = digests
    # The state words are numbers; a digest is their big-endian bytes.
    host = in_order.cpu().numpy().view("<u4").astype(">u4").tobytes()
    at = 0
    for i, n in zip(live, counts, strict=True):
        out[i] = host[at * 32 : (at + n) * 32]
        at += n
    del flats  # the copies (non-contiguous views) lived until the digests came back
    return out
