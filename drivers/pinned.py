"""Persistent host copies of device tensors, moved at the pinned-copy limit.

``HostCopies`` keeps, per key (a weight tag such as ``actor``, or the
optimizer state), ONE flat host buffer holding every tensor of that key at a
fixed offset. The buffer is allocated the first time a key is saved and
reused by every later save with the same layout (names, shapes, dtypes), so
an offload/wake cycle allocates no host memory at all; ``allocations``
counts the buffers ever made, which is how tests pin that down.

On CUDA the buffer is page-locked (pinned) so copies run as DMA:

- it is an ordinary host allocation of exactly the needed size, registered
  with ``cudaHostRegister``. torch's own pinned allocator rounds every
  request up to a power of two, which would hold up to twice the bytes
  (32 GiB for 19 GiB of optimizer state);
- copies are cut into ``chunk_bytes`` pieces issued round-robin on
  ``streams`` copy streams, so small tensors' launch latency overlaps with
  the big ones' transfer and the DMA engine never idles between tensors.
  The streams first wait for the current stream (queued training work), and
  a save or load returns only when its bytes have landed.

Without CUDA the same code runs with plain host memory and ``copy_``: the
CPU machines test every path but the DMA.
"""

from __future__ import annotations

import mmap
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_fsm.drivers.errors import HostCopyMissingError
from miles_fsm.errors import ConfigError

__all__ = ["ChunkedCopier", "HostCopies", "PinnedConfig", "Transfer", "host_buffer"]

_HUGE = 2 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class PinnedConfig:
    """How host copies are held and moved."""

    #: Page-lock host buffers for CUDA sources (without it, copies are synchronous and slow).
    pin: bool = True
    #: Size of one copy; large enough to amortize a launch, small enough to interleave streams.
    chunk_bytes: int = 64 << 20
    #: Copy streams the chunks rotate over.
    streams: int = 2
    #: Each tensor starts at a multiple of this many bytes in the flat buffer.
    align: int = 4096
    #: Back host buffers with transparent huge pages (where the kernel allows them):
    #: fewer page faults when a buffer is first filled.
    huge_pages: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.chunk_bytes < 1 << 20:
            problems.append(f"chunk_bytes must be >= 1 MiB, got {self.chunk_bytes}")
        if self.streams < 1:
            problems.append(f"streams must be >= 1, got {self.streams}")
        if self.align < 1 or self.align & (self.align - 1):
            problems.append(f"align must be a power of two, got {self.align}")
        if problems:
            raise ConfigError(problems, "PinnedConfig")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One save (device to host) or load (host to device) of one key."""

    key: str
    op: str  # "save" or "load"
    nbytes: int
    seconds: float
    #: Seconds spent allocating (and pinning) a new host buffer; 0 when one was reused.
    alloc_s: float = 0.0
    #: False for a save or load that returned once its copies were queued (``wait=False``):
    #: ``seconds`` is then the time to issue them, not to land them.
    waited: bool = True

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(slots=True, eq=False)
class _Slot:
    """One key's flat host buffer and the views into it."""

    layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    buffer: torch.Tensor
    views: dict[str, torch.Tensor]
    offsets: dict[str, tuple[int, int]]
    pinned: bool
    registered: bool
    finalizer: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.offsets.values())


class HostCopies:
    """Host copies by key, in persistent (pinned on CUDA) flat buffers.

    ``save(key, tensors)`` copies the tensors out; ``load(key, tensors)``
    copies the held bytes back into live tensors of the same names, shapes
    and dtypes; ``views(key)`` hands out the host tensors themselves.
    """

    def __init__(self, *, config: PinnedConfig | None = None) -> None:
        self.config = config or PinnedConfig()
        self._slots: dict[str, _Slot] = {}
        self._streams: dict[torch.device, list[torch.cuda.Stream]] = {}
        self.allocations = 0
        self.log: list[Transfer] = []

    # ------------------------------------------------------------- facts

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def keys(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def host_bytes(self, key: str | None = None) -> int:
        """Bytes of tensor data held (one key, or all)."""
        slots = [self._slots[key]] if key is not None and key in self._slots else []
        if key is None:
            slots = list(self._slots.values())
        return sum(s.nbytes for s in slots)

    def reserved_bytes(self, key: str | None = None) -> int:
        """Host bytes the buffers occupy, alignment padding included."""
        slots = [self._slots[key]] if key is not None and key in self._slots else []
        if key is None:
            slots = list(self._slots.values())
        return sum(s.buffer.numel() for s in slots)

    def pinned_bytes(self) -> int:
        return sum(s.buffer.numel() for s in self._slots.values() if s.pinned)

    def views(self, key: str) -> dict[str, torch.Tensor]:
        """The host tensors held for ``key`` (views into its buffer; valid until the next save)."""
        return dict(self._slot(key).views)

    # ------------------------------------------------------------- moves

    def save(self, key: str, tensors: Mapping[str, torch.Tensor], *, wait: bool = True) -> Transfer:
        """Copy ``tensors`` into ``key``'s buffer, reusing it when the layout is unchanged.

        ``wait=False`` (CUDA): return once the copies are queued; the held
        bytes are valid after ``synchronize()``, and the sources must not
        change or be unmapped before it.
        """
        t0 = time.perf_counter()
        layout = tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
        slot = self._slots.get(key)
        alloc_s = 0.0
        if slot is None or slot.layout != layout:
            a0 = time.perf_counter()
            pin = self.config.pin and any(t.is_cuda for t in tensors.values())
            self.drop(key)
            slot = self._slots[key] = self._allocate(layout, pin)
            alloc_s = time.perf_counter() - a0
        pairs = [(slot.views[n], t.detach()) for n, t in tensors.items()]
        waited = self._copy(pairs, wait=wait)
        return self._logged(key, "save", slot.nbytes, time.perf_counter() - t0, alloc_s, waited)

    def load(self, key: str, tensors: Mapping[str, torch.Tensor], *, wait: bool = True) -> Transfer:
        """Copy ``key``'s held bytes back into ``tensors`` (every held name must be there).

        ``wait=False`` (CUDA): return once the copies are queued. The current
        stream is made to wait for them, so every later kernel or copy issued
        on it (the cast, the param sync, the next step, a digest) sees the
        loaded bytes; only the host does not wait. The host buffer is
        written again by the next ``save`` only, which the copy streams order
        after these loads.
        """
        t0 = time.perf_counter()
        slot = self._slot(key)
        missing = sorted(set(slot.views) - set(tensors))
        if missing:
            raise ConfigError(
                [f"load({key!r}): no live tensor for held {', '.join(missing[:8])}"], "HostCopies.load"
            )
        pairs = []
        for name, host in slot.views.items():
            live = tensors[name]
            if tuple(live.shape) != tuple(host.shape) or live.dtype != host.dtype:
                raise ConfigError(
                    [
                        f"load({key!r}): {name} is {list(live.shape)}:{live.dtype} live but "
                        f"{list(host.shape)}:{host.dtype} held"
                    ],
                    "HostCopies.load",
                )
            pairs.append((live.detach(), host))
        waited = self._copy(pairs, wait=wait)
        return self._logged(key, "load", slot.nbytes, time.perf_counter() - t0, 0.0, waited)

    def synchronize(self) -> None:
        """Wait (host) for every copy queued so far."""
        for streams in self._streams.values():
            for s in streams:
                s.synchronize()

    def drop(self, key: str) -> None:
        """Free ``key``'s buffer (unregistering it first)."""
        slot = self._slots.pop(key, None)
        if slot is not None and slot.finalizer is not None:
            slot.finalizer()

    def close(self) -> None:
        for key in list(self._slots):
            self.drop(key)

    # ------------------------------------------------------------- internals

    def _slot(self, key: str) -> _Slot:
        if key not in self._slots:
            raise HostCopyMissingError(tag=key, held=list(self._slots))
        return self._slots[key]

    def _logged(
        self, key: str, op: str, nbytes: int, seconds: float, alloc_s: float, waited: bool = True
    ) -> Transfer:
        rec = Transfer(key, op, nbytes, seconds, alloc_s, waited)
        self.log.append(rec)
        return rec

    def _allocate(self, layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...], pin: bool) -> _Slot:
        align = self.config.align
        offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for name, shape, dtype in layout:
            start = -(-end // align) * align
            n = _numel(shape) * _itemsize(dtype)
            offsets[name] = (start, start + n)
            end = start + n
        total = max(end, 1)
        buffer, registered, finalizer = host_buffer(total, pin=pin, huge_pages=self.config.huge_pages)
        self.allocations += 1
        views = {}
        for name, shape, dtype in layout:
            a, b = offsets[name]
            views[name] = buffer[a:b].view(dtype).view(shape) if b > a else torch.empty(shape, dtype=dtype)
        return _Slot(layout, buffer, views, offsets, pinned=pin, registered=registered, finalizer=finalizer)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, wait: bool) -> bool:
        """Run the copies; returns whether the host waited for all of them."""
        cuda = [(d, s) for d, s in pairs if d.is_cuda or s.is_cuda]
        for dst, src in pairs:
            if not (dst.is_cuda or src.is_cuda):
                dst.copy_(src)
        if cuda:
            self._copy_cuda(cuda, wait=wait)
        return wait or not cuda

    def _copy_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, wait: bool) -> None:
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            by_device.setdefault(dst.device if dst.is_cuda else src.device, []).append((dst, src))
        for device, group in by_device.items():
            streams = self._device_streams(device)
            current = torch.cuda.current_stream(device)
            for s in streams:
                s.wait_stream(current)
            with torch.cuda.device(device):
                ChunkedCopier(streams, self.config.chunk_bytes).copy(group)
            # Later work on the current stream sees the copied bytes.
            for s in streams:
                current.wait_stream(s)
            if wait:
                for s in streams:
                    s.synchronize()

    def _device_streams(self, device: torch.device) -> list[torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = [torch.cuda.Stream(device=device) for _ in range(self.config.streams)]
        return self._streams[device]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class ChunkedCopier:
    """Queues copies in ``chunk_bytes`` pieces, round-robin over ``streams``; nothing waits.

    Small tensors' launch latency overlaps with the big ones' transfer, and
    the DMA engines never idle between tensors. The caller orders the
    streams against its own work.
    """

    def __init__(self, streams: Sequence[torch.cuda.Stream], chunk_bytes: int) -> None:
        self._streams = list(streams)
        self._chunk = chunk_bytes
        self._next = 0

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue ``dst.copy_(src)`` for each pair (a pair not contiguous on both sides goes whole)."""
        for dst, src in pairs:
            if not (dst.is_contiguous() and src.is_contiguous()):
                self._issue(dst, src)
                continue
            d, s = _bytes(dst), _bytes(src)
            for a in range(0, d.numel(), self._chunk):
                self._issue(d[a : a + self._chunk], s[a : a + self._chunk])

    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._streams[self._next % len(self._streams)]):
            dst.copy_(src, non_blocking=True)
        self._next += 1


def host_buffer(nbytes: int, *, pin: bool, huge_pages: bool = False) -> tuple[torch.Tensor, bool, Any]:
    """A host buffer of exactly ``nbytes``; registered (pinned) with CUDA when ``pin``.

    ``huge_pages`` backs it with transparent huge pages where the kernel
    allows them (``madvise`` or ``always`` in
    ``/sys/kernel/mm/transparent_hugepage/enabled``): a 2 MiB-aligned
    anonymous mapping advised ``MADV_HUGEPAGE``. Faulting it in then takes
    one fault per 2 MiB instead of per 4 KiB. Returns the buffer, whether it
    is registered, and a finalizer that unregisters it before its memory can
    go back to the OS.
    """
    owner: Any = None
    if huge_pages and nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        owner = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        owner.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(owner, dtype=torch.uint8)
        skip = -whole.data_ptr() % _HUGE
        buffer = whole[skip : skip + nbytes]
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pin:
        return buffer, False, None
    buffer.zero_()  # fault the pages in on every core; registering alone does it on one
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        # Registration refused (e.g. a locked-memory limit): fall back to torch's
        # pinned allocator, which rounds up to a power of two.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False, None
    # The mapping rides along with the finalizer, so it outlives the registration.
    return buffer, True, weakref.finalize(buffer, _unregister, buffer.data_ptr(), owner)


def _unregister(ptr: int, owner: Any) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
