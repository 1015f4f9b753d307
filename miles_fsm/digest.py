"""Tensor digests for verification: chunked SHA256, on the GPU or on every host core.

The digest of one tensor under a scheme of ``SCHEMES`` (``DIGEST_SCHEME``,
"chunked-sha256/v2", by default):

1. ``B``: the tensor's bytes in its own dtype, row-major (as ``.contiguous()``
   lays them out);
2. cut ``B`` into chunks of the scheme's chunk size (v1: 4 MiB, v2: 64 KiB);
   the last chunk may be shorter, and an empty tensor has no chunk;
3. ``digest = SHA256(TAG || u64le(chunk size) || u64le(len(B)) ||
   SHA256(chunk_0) || SHA256(chunk_1) || ...)``, as hex, where ``TAG`` is
   ``b"miles-fsm chunked-sha256 v1\x00"`` (``v2`` for v2).

v2 differs from v1 only in its chunk size (and tag): a GPU fills its cores
with one lane per chunk, and 4 MiB chunks leave too few lanes.

A single SHA256 over a tensor is sequential, so one 400 MB embedding would
take one core a fifth of a second. The chunk digests are independent, so a
thread pool computes them in parallel (hashlib releases the GIL on buffers
over 2 KiB), and the root ties them back together: any changed byte changes
its chunk's digest and so the root. The definition is the same for host and
device tensors; only how the bytes reach the hashers differs:

- CUDA tensors are hashed on their device (``miles_fsm.digest_device``, a
  Triton kernel) where Triton is installed: only the chunk digests come
  back, and the root is hashed here;
- host tensors are hashed in place (zero-copy views);
- otherwise (``on_device=False``, or no Triton) CUDA tensors stream through a small ring of persistent pinned staging
  slots: a copy stream moves one slot device-to-host while the hashers work
  on the slots already landed, so the copy and the hashing overlap and no
  pinned memory is allocated per call.

A digest only has to equal itself across an offload/wake cycle: it is never
compared with ``sha256sum`` of a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import queue
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import cast

import torch

from miles_fsm import digest_device
from miles_fsm.errors import ConfigError, MemoryReleasedError

__all__ = ["CHUNK_BYTES", "DIGEST_SCHEME", "SCHEMES", "PendingDigests", "StagingRing", "default_threads",
           "digest_tensors", "start_digests", "tensor_digest", "tensor_sha256"]  # fmt: skip

#: Scheme -> chunk size. The chunk size is part of the definition: change it and every digest
#: changes, so a new size is a new scheme. Every chunk size divides ``CHUNK_BYTES``.
SCHEMES: Mapping[str, int] = MappingProxyType({"chunked-sha256/v1": 4 << 20, "chunked-sha256/v2": 64 << 10})
DIGEST_SCHEME = "chunked-sha256/v2"
#: v1's chunk size, and the host's unit of work under every scheme (one hasher job, one staged piece).
CHUNK_BYTES = 4 << 20
#: Below this many bytes in all, hashing inline beats starting a thread pool.
_INLINE_BYTES = 8 << 20
_ALIGN = 512


def default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def _chunk_of(scheme: str) -> int:
    if scheme not in SCHEMES:
        raise ConfigError([f"unknown digest scheme {scheme!r}: pass one of {sorted(SCHEMES)}"], "digest")
    return SCHEMES[scheme]


def _root(scheme: str, nbytes: int, leaves: list[bytes]) -> str:
    tag = b"miles-fsm chunked-sha256 " + scheme.rsplit("/", 1)[1].encode() + b"\x00"
    return hashlib.sha256(tag + struct.pack("<QQ", SCHEMES[scheme], nbytes) + b"".join(leaves)).hexdigest()


def _leaves(data: memoryview, chunk: int) -> bytes:
    """The chunk digests of ``data`` (a whole number of chunks, but for a tensor's last piece), joined."""
    return b"".join(hashlib.sha256(data[a : a + chunk]).digest() for a in range(0, len(data), chunk))


def _n_chunks(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def _check_resident(t: torch.Tensor) -> None:
    """A CPU tensor whose storage was released (a paused region) must not be read through a pointer."""
    if t.device.type == "cpu" and t.numel():
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        needed = (t.storage_offset() + extent) * t.element_size()
        if t.untyped_storage().nbytes() < needed:
            raise MemoryReleasedError(owner="verification", op="hash a tensor", tags=(), reason="its storage is released")


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a zero-copy view (copied only when not contiguous).

    Through ctypes, not ``.numpy()``: numpy marks the storage non-resizable,
    and a paused region's storage must stay resizable.
    """
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    arr = (ctypes.c_char * nbytes).from_address(flat.data_ptr())
    arr._keep = flat  # type: ignore[attr-defined]  # the view must not outlive the bytes
    return memoryview(arr).cast("B")


def tensor_digest(t: torch.Tensor, *, scheme: str = DIGEST_SCHEME) -> str:
    """The chunked SHA256 of one tensor, on this thread, on the host (see the module docstring)."""
    chunk = _chunk_of(scheme)
    _check_resident(t)
    if t.device.type != "cpu":
        t = t.to("cpu")
    view = _host_bytes(t)
    return _root(scheme, len(view), [_leaves(view, chunk)])


def tensor_sha256(t: torch.Tensor) -> str:
    """Plain SHA256 of a tensor's bytes (one sequential hash; kept for callers that need exactly that)."""
    _check_resident(t)
    if t.device.type != "cpu":
        t = t.to("cpu")
    return hashlib.sha256(_host_bytes(t)).hexdigest()


def digest_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    threads: int | None = None,
    scheme: str = DIGEST_SCHEME,
    on_device: bool | None = None,
) -> dict[str, str]:
    """``tensor_digest`` of each named tensor under ``scheme``; the result keeps the mapping's order.

    CUDA tensors are hashed on their device (``on_device``: None means where
    ``digest_device.available()``), else through the pinned staging ring of
    their device; host tensors are hashed in place. Host chunks are hashed on
    ``threads`` threads. ``start_digests(...).result()``.
    """
    return start_digests(tensors, threads=threads, scheme=scheme, on_device=on_device).result()


class PendingDigests:
    """Digests whose device part may still be running (``start_digests``); ``wait()`` lands it, once."""

    def __init__(self, scheme: str, names: list[str], sizes: dict[str, int], leaves: dict[str, list[bytes | None]],
                 on_device: list[tuple[list[str], digest_device.PendingChunks]]) -> None:  # fmt: skip
        self._scheme, self._names, self._sizes, self._leaves, self._on_device = scheme, names, sizes, leaves, on_device
        self._out: dict[str, str] | None = None

    @property
    def ready(self) -> bool:
        """Whether ``wait()`` would return without waiting for a device."""
        return not self._on_device or all(p.ready for _, p in self._on_device)

    def wait(self) -> dict[str, list[bytes | None]]:
        """Per name, its chunk digests, the device's waited for and landed (which frees the kernel's copies)."""
        for dev_names, pending in self._on_device:
            for name, joined in zip(dev_names, pending.result(), strict=True):
                self._leaves[name] = [joined]
        self._on_device = []
        return self._leaves

    def chunks(self) -> dict[str, bytes]:
        """Per name, its chunk digests joined (no root hashed): for equal sizes, equal exactly when the digests are."""
        return {name: b"".join(cast("list[bytes]", parts)) for name, parts in self.wait().items()}

    def result(self) -> dict[str, str]:
        if self._out is None:
            self._out = _roots(self._scheme, self._names, self._sizes, self.wait())
        return self._out


def start_digests(
    tensors: Mapping[str, torch.Tensor],
    *,
    threads: int | None = None,
    scheme: str = DIGEST_SCHEME,
    on_device: bool | None = None,
) -> PendingDigests:
    """``digest_tensors``, but CUDA tensors hashed on their device are only queued: the call returns
    while the kernel runs on a side stream, so the caller's own device work (an offload's
    copies) overlaps it. The tensors must stay resident and unchanged until ``wait()``.
    Host hashing (host tensors, or CUDA tensors without a device digest) is done before returning.
    """
    chunk = _chunk_of(scheme)
    n_threads = threads or default_threads()
    for t in tensors.values():
        _check_resident(t)
    names = list(tensors)
    device_side = digest_device.available() if on_device is None else on_device
    leaves: dict[str, list[bytes | None]] = {}
    sizes: dict[str, int] = {}
    by_device: dict[torch.device, list[str]] = {}
    host: list[tuple[str, memoryview]] = []
    for name in names:
        t = tensors[name]
        if t.device.type == "cuda":
            by_device.setdefault(t.device, []).append(name)
            sizes[name] = t.numel() * t.element_size()
        else:
            if t.device.type != "cpu":
                t = t.to("cpu")
            view = _host_bytes(t)
            host.append((name, view))
            sizes[name] = len(view)
        leaves[name] = [None] * _n_chunks(sizes[name])
    queued: list[tuple[list[str], digest_device.PendingChunks]] = []
    if device_side:
        queued = [(ns, digest_device.launch([tensors[n] for n in ns], chunk)) for ns in by_device.values()]
        by_device = {}
    total = sum(sizes[name] for name, _ in host) + sum(sizes[n] for ns in by_device.values() for n in ns)
    if n_threads == 1 or (total <= _INLINE_BYTES and not by_device):
        for name, view in host:
            leaves[name] = [_leaves(view, chunk)]
        for dev_names in by_device.values():
            for name in dev_names:
                leaves[name] = [_leaves(_host_bytes(tensors[name].to("cpu")), chunk)]
        return PendingDigests(scheme, names, sizes, leaves, queued)
    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="miles-fsm-sha") as pool:
        futures: list[Future[None]] = []
        for name, view in host:
            slots = leaves[name]
            for i, a in enumerate(range(0, len(view), CHUNK_BYTES)):
                futures.append(pool.submit(_leaf_into, slots, i, view[a : a + CHUNK_BYTES], chunk))
        for device, dev_names in by_device.items():
            ring = StagingRing.for_device(device)
            futures.extend(ring.stream({n: tensors[n] for n in dev_names}, leaves, pool, chunk=chunk))
        for f in futures:
            f.result()  # re-raises a hasher's error here
    return PendingDigests(scheme, names, sizes, leaves, queued)


def _roots(scheme: str, names: list[str], sizes: dict[str, int],
           leaves: dict[str, list[bytes | None]]) -> dict[str, str]:  # fmt: skip
    # Every leaf is hashed by now (each hasher finished, or re-raised its error): none is still None.
    return {name: _root(scheme, sizes[name], cast("list[bytes]", leaves[name])) for name in names}


def _leaf_into(slots: list[bytes | None], i: int, data: memoryview, chunk: int) -> None:
    slots[i] = _leaves(data, chunk)


class StagingRing:
    """Persistent pinned staging slots on one CUDA device, filled by a copy stream.

    One ring per device, allocated on first use and kept for the process
    (``slots * slot_bytes`` pinned bytes, 512 MiB by default): verification
    never allocates pinned memory per call. A lock makes concurrent callers
    take turns.
    """

    _rings: dict[torch.device, StagingRing] = {}
    _rings_lock = threading.Lock()

    def __init__(self, device: torch.device, *, slots: int = 8, slot_bytes: int = 64 << 20) -> None:
        if slot_bytes % CHUNK_BYTES:
            raise ValueError(f"slot_bytes must be a multiple of {CHUNK_BYTES}, got {slot_bytes}")
        self.device = device
        self.slot_bytes = slot_bytes
        # One power-of-two block: torch's pinned allocator rounds up to one anyway.
        self._host = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
        self._slots = [self._host[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
        # torch leaves Stream.__new__ unannotated.
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    @classmethod
    def for_device(cls, device: torch.device) -> StagingRing:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with cls._rings_lock:
            ring = cls._rings.get(device)
            if ring is None:
                ring = cls._rings[device] = cls(device)
            return ring

    @property
    def pinned_bytes(self) -> int:
        return self._host.numel()

    def stream(
        self,
        tensors: Mapping[str, torch.Tensor],
        leaves: dict[str, list[bytes | None]],
        pool: ThreadPoolExecutor,
        *,
        chunk: int = CHUNK_BYTES,
    ) -> list[Future[None]]:
        """Copy ``tensors`` through the ring and hash each ``chunk``-byte chunk into ``leaves`` on ``pool``.

        Pieces of several tensors share a slot; a tensor larger than what is
        left of a slot is split at a ``CHUNK_BYTES`` boundary, so every chunk
        lands whole in one slot; ``leaves[name][i]`` holds the joined digests
        of the tensor's ``i``-th ``CHUNK_BYTES`` piece. Returns when every copy is issued and every chunk
        is queued; the caller waits on the futures.
        """
        with self._lock:
            return self._stream_locked(tensors, leaves, pool, chunk)

    def _stream_locked(
        self,
        tensors: Mapping[str, torch.Tensor],
        leaves: dict[str, list[bytes | None]],
        pool: ThreadPoolExecutor,
        chunk: int,
    ) -> list[Future[None]]:
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(self._slots)):
            free.put(i)
        futures: list[Future[None]] = []
        # Everything queued on the current stream (the training step) must land first.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        sources = {n: t.detach().contiguous().reshape(-1).view(torch.uint8) for n, t in tensors.items() if t.numel()}
        slot, used = -1, 0
        pieces: list[tuple[str, int, int, int]] = []  # (name, first chunk index, offset in slot, nbytes)

        def flush() -> None:
            nonlocal slot, used, pieces
            if slot < 0 or not pieces:
                return
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: Event.__new__ is unannotated
            event.record(self._stream)
            jobs = [
                (name, first + k, off + k * CHUNK_BYTES, min(CHUNK_BYTES, nbytes - k * CHUNK_BYTES))
                for name, first, off, nbytes in pieces
                for k in range(_n_chunks(nbytes))
            ]
            countdown = _Countdown(len(jobs), functools.partial(free.put, slot))
            buf = self._slots[slot]
            for name, index, off, n in jobs:
                futures.append(pool.submit(_hash_staged, event, buf, off, n, chunk, leaves[name], index, countdown))
            slot, used, pieces = -1, 0, []

        with torch.cuda.device(self.device):
            for name, src in sources.items():
                done, total = 0, src.numel()
                while done < total:
                    if slot < 0:
                        slot = free.get()  # blocks until the hashers release one
                    room = self.slot_bytes - used
                    take = total - done
                    if take > room:
                        take = room // CHUNK_BYTES * CHUNK_BYTES
                        if take == 0:
                            flush()
                            continue
                    with torch.cuda.stream(self._stream):
                        self._slots[slot][used : used + take].copy_(src[done : done + take], non_blocking=True)
                    pieces.append((name, done // CHUNK_BYTES, used, take))
                    done += take
                    used = -(-(used + take) // _ALIGN) * _ALIGN
                    if used >= self.slot_bytes:
                        flush()
            flush()
            # The sources may be temporaries (.contiguous()); keep them until the copies ran.
            self._stream.synchronize()
        return futures


class _Countdown:
    """Calls ``done`` once ``n`` jobs have finished (the slot is free again)."""

    def __init__(self, n: int, done: Callable[[], object]) -> None:
        self._n = n
        self._done = done
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._done()


def _hash_staged(
    event: torch.cuda.Event,
    buf: torch.Tensor,
    off: int,
    n: int,
    chunk: int,
    slots: list[bytes | None],
    index: int,
    countdown: _Countdown,
) -> None:
    try:
        event.synchronize()  # releases the GIL while the copy lands
        slots[index] = _leaves(_host_bytes(buf[off : off + n]), chunk)
    finally:
        countdown.tick()
