"""torch_memory_saver's pause/resume-by-tag contract, on CPU.

A region is one flat tensor allocated under a tag. ``pause(tag)`` releases
the storage of every region of that tag (``untyped_storage().resize_(0)``);
views into it stay valid objects but hold no memory. ``resume(tag)``
reallocates the storage in place, so every view sees it again. Its contents
come back only for regions created with ``backup=True`` (torch_memory_saver's
``enable_cpu_backup``); every other region comes back *poisoned* (all bytes
0xFF: NaN in every float dtype), so a restore that forgets a tensor is caught
by verification instead of silently reading stale bytes that happened to
survive.

``MemorySaver`` is the seam: the reference trainer and engine allocate
through it, so on CUDA the real torch_memory_saver (``drivers/tms.py``) can
stand in for ``CpuMemorySaver``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from miles_fsm.states.errors import MemoryTagError

__all__ = ["POISON_BYTE", "CpuMemorySaver", "MemorySaver", "PauseResume", "Region"]

#: Every byte of a region resumed without backup. 0xFF.. is NaN in fp32,
#: bf16 and fp16 alike, and -1 in signed ints, so nothing passes for data.
POISON_BYTE = 0xFF


@runtime_checkable
class MemorySaver(Protocol):
    """Pausable memory by tag: what the reference drivers need from torch_memory_saver."""

    @property
    def device(self) -> torch.device:
        """Where regions live."""
        ...

    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor:
        """Allocate one flat, pausable tensor under ``tag`` (zero-filled).

        ``backup=True`` keeps a host copy across a pause, like
        ``torch_memory_saver.region(tag, enable_cpu_backup=True)``.
        """
        ...

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        """Release every region of ``tag``. Pausing a paused tag raises.

        ``synchronize=False``: the caller guarantees that no queued device
        work touches the tag's memory, so the saver need not wait for the
        device first (the caller may have unrelated copies in flight).
        """
        ...

    def resume(self, tag: str) -> None:
        """Reallocate every region of ``tag``. Resuming an active tag raises."""
        ...

    @property
    def paused_tags(self) -> frozenset[str]:
        """Tags paused now."""
        ...

    def resident_bytes(self, tags: Iterable[str] | None = None) -> int:
        """Bytes held on the device now by regions of ``tags`` (None: all tags)."""
        ...

    def host_bytes(self, tags: Iterable[str] | None = None) -> int:
        """Host bytes held now by the saver's own backups."""
        ...


class PauseResume(Protocol):
    """The part of a memory saver that the Megatron driver calls during the lifecycle (its ``memory=``)."""

    def pause(self, tag: str, *, synchronize: bool = True) -> None: ...

    def resume(self, tag: str) -> None: ...


@dataclass(slots=True, eq=False)
class Region:
    """One flat allocation under a tag."""

    tag: str
    tensor: torch.Tensor
    backup: bool
    host: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def resident(self) -> bool:
        return self.tensor.untyped_storage().nbytes() > 0


class CpuMemorySaver:
    """The CPU stand-in for torch_memory_saver. One per process (or per trainer/engine pair).

    Misuse that would kill a process under torch_memory_saver (pausing a
    paused tag, resuming an active one) raises ``MemoryTagError`` here.
    It also keeps a high-water mark of resident bytes so a caller can report
    the peak of each phase (``reset_peak`` / ``peak_bytes``).
    """

    def __init__(self, *, name: str = "cpu-memory-saver") -> None:
        self.name = name
        self._regions: list[Region] = []
        self._paused: set[str] = set()
        self._peak = 0
        # Per-tag bytes, kept as regions are made, paused and resumed: reading them walks no region
        # (the drift snapshot reads them at every state).
        self._bytes: dict[str, int] = {}
        self._held: dict[str, int] = {}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor:
        if tag in self._paused:
            raise MemoryTagError(side=self.name, tag=tag, op="allocate in", paused=self._paused)
        tensor = torch.zeros(numel, dtype=dtype)
        self._regions.append(Region(tag=tag, tensor=tensor, backup=backup))
        self._bytes[tag] = self._bytes.get(tag, 0) + tensor.numel() * tensor.element_size()
        self._touch()
        return tensor

    @property
    def paused_tags(self) -> frozenset[str]:
        return frozenset(self._paused)

    @property
    def tags(self) -> frozenset[str]:
        return frozenset(r.tag for r in self._regions)

    def regions(self, tag: str | None = None) -> tuple[Region, ...]:
        return tuple(r for r in self._regions if tag is None or r.tag == tag)

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        # Host memory: nothing is queued, so synchronize has nothing to wait for.
        if tag in self._paused:
            raise MemoryTagError(side=self.name, tag=tag, op="pause", paused=self._paused)
        for region in self.regions(tag):
            if region.backup:
                region.host = region.tensor.detach().clone()
            region.tensor.untyped_storage().resize_(0)
        self._held[tag] = sum(r.host.numel() * r.host.element_size() for r in self.regions(tag) if r.host is not None)
        self._paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag not in self._paused:
            raise MemoryTagError(side=self.name, tag=tag, op="resume", paused=self._paused)
        for region in self.regions(tag):
            region.tensor.untyped_storage().resize_(region.nbytes)
            if region.host is not None:
                region.tensor.copy_(region.host)
                region.host = None
            else:
                _poison(region.tensor)
        self._held.pop(tag, None)
        self._paused.discard(tag)
        self._touch()

    def resident_bytes(self, tags: Iterable[str] | None = None) -> int:
        paused = self._paused
        return sum(self._bytes.get(t, 0) for t in (self._bytes if tags is None else set(tags)) if t not in paused)

    def host_bytes(self, tags: Iterable[str] | None = None) -> int:
        return sum(self._held.get(t, 0) for t in (self._held if tags is None else set(tags)))

    def peak_bytes(self) -> int:
        """The most bytes resident at once since the last ``reset_peak``."""
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.resident_bytes()

    def _touch(self) -> None:
        self._peak = max(self._peak, self.resident_bytes())


def _poison(tensor: torch.Tensor) -> None:
    torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).fill_(POISON_BYTE)
