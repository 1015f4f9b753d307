"""Chunk digests computed where the tensors are: SHA-256 on the GPU, one lane per chunk.

``launch`` queues the hashing of every chunk of every tensor it is given as
one kernel (``miles_fsm.digest_kernel``, Triton, imported on first use so
that a CPU-only install never needs Triton) on a side stream, and returns at
once: the caller's stream keeps running (an offload's copies, say) while the
kernel hashes. ``PendingChunks.result()`` waits for it. Only the chunk
digests, 32 bytes each, come back to the host; ``miles_fsm.digest`` ties them
into each tensor's root exactly as it does for chunks hashed on the host, so
both paths give the same digest under every scheme.

A tensor is hashed as its bytes in row-major order: a contiguous tensor
whose first byte is 16-byte aligned is read in place; any other is first
copied on the device. The chunk table (where each chunk starts, how long it
is) is built on the device; chunks are sorted by length, so the lanes of one
program do the same number of blocks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Sequence

import torch

from miles_fsm.errors import ConfigError

__all__ = ["LANES", "MAXNREG", "NUM_WARPS", "PendingChunks", "available", "chunk_digests", "launch"]

#: Lanes (chunks) per program, and warps per program: one lane per thread.
LANES = 128
NUM_WARPS = 4
#: Registers per thread, capped on CUDA: uncapped, the kernel's lanes fill about two programs per
#: SM, so 3.2 GB of 64 KiB chunks (386 programs) ran as two waves, the second half empty, and took
#: as long as 4.3 GB (docs/benchmarks.md, issue 27). At 128, more programs are resident at once.
MAXNREG = 128
#: The kernel reads 16-byte rows; a tensor whose bytes start elsewhere is copied first.
_ALIGN = 16


@functools.cache
def _has_triton() -> bool:
    # Asked on every guarded transition (Actions.verifies): the import system is searched once a process.
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether CUDA tensors can be hashed on their device here (a CUDA device and Triton present)."""
    return torch.cuda.device_count() > 0 and _has_triton()


def _readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where the kernel can read it in place, else a contiguous aligned copy.

    Megatron's params are contiguous, aligned views into their bucket: for them
    this costs two attribute reads and no new tensor, which matters at hundreds
    of tensors per call.
    """
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    flat = t.detach().contiguous()
    return flat if flat.data_ptr() % _ALIGN == 0 else flat.clone()  # a fresh block from the allocator is aligned


class PendingChunks:
    """Chunk digests being computed on a side stream; ``result()`` waits for them (once)."""

    def __init__(self, n: int, counts: list[tuple[int, int]], host: torch.Tensor | None,
                 done: torch.cuda.Event | None, keep: list[torch.Tensor]) -> None:  # fmt: skip
        self._n = n
        self._counts = counts  # (index in the input, chunks) of each non-empty tensor, in order
        self._host = host
        self._done = done
        self._keep: list[torch.Tensor] | None = keep  # the inputs and copies, alive until the kernel ran
        self._out: list[bytes] | None = None

    @property
    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self._out is not None or self._done is None or bool(self._done.query())  # type: ignore[no-untyped-call]  # torch: unannotated

    def result(self) -> list[bytes]:
        """Per input tensor, its chunk digests concatenated (32 bytes each); ``b""`` for an empty one."""
        if self._out is None:
            out = [b""] * self._n
            if self._host is not None:
                if self._done is not None:
                    self._done.synchronize()
                # The state words are numbers; a digest is their big-endian bytes.
                raw = self._host.numpy().view("<u4").astype(">u4").tobytes()
                at = 0
                for i, n in self._counts:
                    out[i] = raw[at * 32 : (at + n) * 32]
                    at += n
            self._out, self._keep, self._host = out, None, None
        return self._out


def launch(tensors: Sequence[torch.Tensor], chunk: int, *, lanes: int = LANES, num_warps: int = NUM_WARPS,
           maxnreg: int | None = MAXNREG) -> PendingChunks:  # fmt: skip
    """Queue the SHA-256 of each ``chunk``-byte piece of each tensor's bytes; return without waiting.

    All tensors must be on one device: CUDA, or the host under ``TRITON_INTERPRET=1`` (the
    tests). On CUDA the kernel runs on a side stream that first waits for the current
    stream, so it hashes what the work queued so far leaves. The tensors must not be
    released or written until ``result()`` returned. ``lanes``, ``num_warps`` and
    ``maxnreg`` (a register cap per thread; None: uncapped; CUDA only) shape the launch:
    benchmarks/gpu_digest.py tries them.
    """
    if chunk <= 0 or chunk % 64:
        raise ConfigError([f"chunk must be a positive multiple of 64 bytes, got {chunk}"], "chunk_digests")
    live = [(i, t) for i, t in enumerate(tensors) if t.numel()]
    if not live:
        return PendingChunks(len(tensors), [], None, None, [])
    devices = {t.device for _, t in live}
    if len(devices) != 1:
        raise ConfigError([f"pass tensors of one device, got {sorted(map(str, devices))}"], "chunk_digests")
    device = devices.pop()
    reads = [_readable(t) for _, t in live]
    side = _side_stream(device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
        for r, (_, t) in zip(reads, live, strict=True):
            if r is not t:  # a copy made on the current stream, read on the side one
                r.record_stream(side)
    ptrs = [r.data_ptr() for r in reads]
    sizes = [r.numel() * r.element_size() for r in reads]
    counts = [-(-n // chunk) for n in sizes]
    low = min(range(len(reads)), key=ptrs.__getitem__)
    base = reads[low].detach().reshape(-1).view(torch.uint8)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        host = _run(base, [(p - ptrs[low]) // 4 for p in ptrs], sizes, counts, chunk, device,
                    lanes=lanes, launch={"num_warps": num_warps} if maxnreg is None or side is None else
                    {"num_warps": num_warps, "maxnreg": maxnreg})  # fmt: skip
        done = torch.cuda.Event() if side is not None else None  # type: ignore[no-untyped-call]  # torch: unannotated
        if done is not None:
            done.record(side)
    return PendingChunks(len(tensors), [(i, n) for (i, _), n in zip(live, counts, strict=True)], host, done, reads)


def _run(base: torch.Tensor, start_words: list[int], sizes: list[int], counts: list[int], chunk: int,
         device: torch.device, *, lanes: int, launch: dict[str, int]) -> torch.Tensor:  # fmt: skip
    """Build the chunk table, launch the kernel, and queue the digests' copy to the host (in input order)."""
    total = sum(counts)
    table = torch.tensor([start_words, sizes, counts], dtype=torch.int64).to(device, non_blocking=True)
    start_of, size_of, count_of = table[0], table[1], table[2]
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), count_of, output_size=total)
    first = torch.cumsum(count_of, 0) - count_of
    k = torch.arange(total, device=device) - first[owner]
    word_off = start_of[owner] + k * (chunk // 4)
    nbytes = torch.clamp(size_of[owner] - k * chunk, max=chunk)
    order = torch.argsort(nbytes, descending=True, stable=True)
    digests = torch.empty((total, 8), dtype=torch.int32, device=device)
    kernel = importlib.import_module("miles_fsm.digest_kernel").sha256_chunks
    # Triton launches on the current device: make it the tensors' one.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(-(-total // lanes),)](base, word_off[order].contiguous(), nbytes[order].contiguous(), digests, total,
                                      LANES=lanes, **launch)  # fmt: skip
    in_order = torch.empty_like(digests)
    in_order[order] = digests
    return in_order.to("cpu", non_blocking=device.type == "cuda")


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch: unannotated
    return _streams[device]


def chunk_digests(tensors: Sequence[torch.Tensor], chunk: int, *, lanes: int = LANES, num_warps: int = NUM_WARPS,
                  maxnreg: int | None = MAXNREG) -> list[bytes]:  # fmt: skip
    """Per tensor, the SHA-256 of each ``chunk``-byte piece of its bytes, concatenated (32 bytes each).

    ``launch(...).result()``: an empty tensor has no chunk and gives ``b""``.
    """
    return launch(tensors, chunk, lanes=lanes, num_warps=num_warps, maxnreg=maxnreg).result()
