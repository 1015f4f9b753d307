"""The live memory drift check: a snapshot at every state the lifecycle reaches, judged cycle by cycle.

A snapshot is a few cheap reads (no walk of tensors): the device bytes per
tag (``TaggedMemory.device_bytes_by_tag`` where a driver's memory saver can
tell, else the trainer's ``memory_in_use()`` under the tag ``total``), the
host bytes per tag (``host_bytes_by_tag``: backups, pinned copies), the
process RSS (``/proc/self/statm``), and, once this process has initialized
CUDA, torch's own counters (``torch_figures``): the caching allocator's
allocated and reserved bytes and the pinned host allocator's bytes, which
see memory a user keeps that no driver accounts for. Engine tags are prefixed
``engine:``, torch's ``torch:``. Each snapshot is traced as
``memory_snapshot``; ``miles_fsm.memory_drift`` judges it (docs/memory-drift.md).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from miles_fsm.config import DriftConfig
from miles_fsm.machine import TransitionResult
from miles_fsm.memory_drift import DriftFinding, DriftTracker, figures_of
from miles_fsm.states.errors import MemoryDriftError
from miles_fsm.trace.schema import MEMORY_DRIFT, MEMORY_SNAPSHOT
from miles_fsm.trace.writer import TraceSink

__all__ = ["DriftMonitor", "MemoryDriftWarning", "TaggedMemory", "process_rss", "torch_figures"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryDriftWarning(RuntimeWarning):
    """A memory figure grows cycle by cycle (``DriftConfig(policy="warn")``); ``finding`` and ``rank`` say which."""

    def __init__(self, message: str, *, rank: int, finding: DriftFinding) -> None:
        super().__init__(message)
        self.rank = rank
        self.finding = finding


@runtime_checkable
class TaggedMemory(Protocol):
    """The optional members of a driver whose memory saver can say what each tag holds."""

    def device_bytes_by_tag(self) -> Mapping[str, int]:
        """Device (on CPU: the saver's) bytes per tag, measured the same way at every call. Cheap.

        A trainer's saver reports what is resident now. An engine that cannot
        ask its server reports what each tag's last resume took back
        (``SGLangEngineDriver``), also while the tag is released: drift is a
        figure of one state growing across cycles, so either measure serves.
        """
        ...

    def host_bytes_by_tag(self) -> Mapping[str, int]:
        """Host bytes held now per tag (backups, pinned copies)."""
        ...


_statm: list[int] = []  # (pid, fd): kept open per process, so a snapshot costs one pread, not an open


def process_rss() -> int | None:
    """This process's resident set size in bytes (one read of ``/proc/self/statm``); None where unknown."""
    try:
        if not _statm or _statm[0] != os.getpid():  # a forked child must not read its parent's statm
            _statm[:] = [os.getpid(), os.open("/proc/self/statm", os.O_RDONLY)]
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _current(stats: Any, *path: str) -> int | None:
    """``stats[path...]["current"]`` of torch's nested allocator stats, or None where a key is missing."""
    for key in (*path, "current"):
        if not isinstance(stats, Mapping) or key not in stats:
            return None
        stats = stats[key]
    return int(stats) if isinstance(stats, int) else None


def torch_figures(torch: Any = None) -> tuple[dict[str, int], dict[str, int]]:
    """This process's CUDA allocator counters: (device, host) per tag; empty where CUDA was never initialized.

    Device: ``torch:allocated`` and ``torch:reserved`` of the current device's
    caching allocator (what tensors hold, and what the cache keeps). Host:
    ``torch:pinned``, the bytes of pinned blocks torch's host allocator owns
    (``pin_memory=True``, ``.pin_memory()``; cached blocks included). Torch is
    never imported here, nor CUDA initialized: a CPU process reads nothing.
    """
    torch = torch if torch is not None else sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return {}, {}
    dev = cuda.memory_stats_as_nested_dict()
    device = {f"torch:{name}": v for name in ("allocated", "reserved")
              if (v := _current(dev, f"{name}_bytes", "all")) is not None}  # fmt: skip
    nested = getattr(cuda, "host_memory_stats_as_nested_dict", None)
    flat = getattr(cuda, "host_memory_stats", None)
    pinned: int | None = None
    if callable(nested):
        pinned = _current(nested(), "allocated_bytes")
    elif callable(flat):  # a torch with only the flat dict
        value = flat().get("allocated_bytes.current")
        pinned = value if isinstance(value, int) else None
    return device, ({} if pinned is None else {"torch:pinned": pinned})


class DriftMonitor:
    """One rank's snapshots and their judgement; ``observe`` is the machine's ``on_commit``."""

    def __init__(self, *, config: DriftConfig, rank: int, trainer: Any, engine: Any | None,
                 tracer: TraceSink) -> None:  # fmt: skip
        self.config = config
        self.rank = rank
        self.tracker = DriftTracker(config)
        self._trainer = trainer
        # Once: a runtime Protocol check walks the protocol's members, and snapshot() runs every transition.
        self._tagged = trainer if isinstance(trainer, TaggedMemory) else None
        self._engine = engine if isinstance(engine, TaggedMemory) else None
        self._tracer = tracer

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], int | None]:
        """(device bytes per tag, host bytes per tag, RSS) now."""
        if self._tagged is not None:
            device, host = dict(self._tagged.device_bytes_by_tag()), dict(self._tagged.host_bytes_by_tag())
        else:
            total = self._trainer.memory_in_use()
            device, host = ({} if total is None else {"total": total}), {}
        if self._engine is not None:
            device.update({f"engine:{k}": v for k, v in self._engine.device_bytes_by_tag().items()})
            host.update({f"engine:{k}": v for k, v in self._engine.host_bytes_by_tag().items()})
        torch_device, torch_host = torch_figures()
        device.update(torch_device)
        host.update(torch_host)
        return device, host, process_rss()

    def observe(self, result: TransitionResult) -> list[DriftFinding]:
        """Snapshot the state just reached, trace it, and warn or raise on drift (per the policy)."""
        if not self.config.enabled:
            return []
        device, host, rss = self.snapshot()
        state, epoch = result.dest.value, result.epoch
        # No trigger: the snapshot is of the state reached, after the transition's own records, which end
        # with its transition_finished (readers that follow one trigger's records rely on that).
        self._tracer.emit(MEMORY_SNAPSHOT, epoch=epoch, state=state, trigger=None,
                          device=device, host=host, rss=rss)  # fmt: skip
        found = self.tracker.add(epoch, state, figures_of(device, host, rss))
        if not found or self.config.policy == "off":
            return found
        for f in found:  # no trigger either: it is a finding about the state reached, like the snapshot
            self._tracer.emit(MEMORY_DRIFT, epoch=epoch, state=state, trigger=None, kind=f.kind,
                              tag=f.tag, at=f.state, first_cycle=f.first_cycle, bytes_per_cycle=f.bytes_per_cycle,
                              slope=f.slope, grown=f.grown, policy=self.config.policy)  # fmt: skip
        errors = [self.error(f) for f in found]
        if self.config.policy == "raise":
            raise errors[0]
        for f, err in zip(found, errors, strict=True):
            message = f"{err.summary}. The run goes on (DriftConfig(policy='warn')); policy='raise' stops it here."
            warnings.warn(MemoryDriftWarning(message, rank=self.rank, finding=f), stacklevel=4)
        return found

    def error(self, f: DriftFinding) -> MemoryDriftError:
        return MemoryDriftError(rank=self.rank, tag=f.tag, state=f.state, first_cycle=f.first_cycle,
                                bytes_per_cycle=f.bytes_per_cycle, slope=f.slope, kind=f.kind,
                                grown=f.grown, inside=f.inside, grew_with=f.grew_with)  # fmt: skip
