"""Leaks from the traces alone: each rank's ``memory_snapshot`` records, judged as the live check judges them.

A pass of its own beside the fold: only lines that name ``memory_snapshot`` (or
``trace_opened``, for the run's ``DriftConfig``) are decoded, so it costs a scan of
the bytes, and the fold and its index stay as they are. The tolerance is the one
the run was traced with (``trace_opened``'s ``drift``), else ``DriftConfig()``'s.
A leak is a finding beside the verdict, never a verdict of its own (the verdict
set is fixed): ``Diagnosis.leaks``; a run with leaks exits 3 (docs/memory-drift.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.config import DriftConfig
from miles_fsm.errors import ConfigError
from miles_fsm.memory_drift import DriftTracker, figures_of
from miles_fsm.replay.checks import invalid, plain_int
from miles_fsm.replay.files import OVERSIZED, iter_lines
from miles_fsm.replay.shapes import Leak
from miles_fsm.trace.schema import MEMORY_SNAPSHOT, TRACE_OPENED

__all__ = ["MemorySeries", "find_leaks", "leak_lines", "leak_note", "memory_series", "read_memory", "unjudged_note"]

_MARKS = (MEMORY_SNAPSHOT.encode(), TRACE_OPENED.encode())


@dataclass(slots=True)
class MemorySeries:
    """One rank's snapshots, in trace order, and the drift config its trace was opened with."""

    rank: int
    config: DriftConfig = field(default_factory=DriftConfig)
    #: (mono_ns, epoch, state, device per tag, host per tag, rss)
    snapshots: list[tuple[int, int, str, dict[str, int], dict[str, int], int | None]] = field(default_factory=list)


def _records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records that name a mark, read as the fold reads lines: in blocks, a line over 16 MiB never read."""
    for _, line, _complete in iter_lines(Path(path)):
        if line is OVERSIZED or not any(m in line for m in _MARKS):
            continue
        try:
            rec = orjson.loads(line)  # nested too deep for it: JSONDecodeError, never a RecursionError
        except orjson.JSONDecodeError:  # damage: the fold reports it; a leak is judged on what parses
            continue
        if rec.__class__ is dict and invalid(rec) is None:
            yield rec


def read_memory(rank: int, path: str | os.PathLike[str], *, run: str | None = None) -> MemorySeries:
    """One rank file's memory snapshots (of ``run``, when given)."""
    series = MemorySeries(rank)
    for rec in _records(path):
        if run is not None and rec.get("run") != run:
            continue
        if rec.get("event") == TRACE_OPENED:
            series.config = _config(rec.get("drift"))
        elif rec.get("event") == MEMORY_SNAPSHOT and isinstance(rec.get("epoch"), int):
            series.snapshots.append((plain_int(rec.get("mono_ns")) or 0, rec["epoch"], str(rec.get("state")),
                                     _ints(rec.get("device")), _ints(rec.get("host")), _int(rec.get("rss"))))  # fmt: skip
    return series


def memory_series(files: Mapping[int, str | os.PathLike[str]], *, run: str | None = None) -> list[MemorySeries]:
    return [read_memory(rank, path, run=run) for rank, path in sorted(files.items())]


def find_leaks(series: list[MemorySeries]) -> list[Leak]:
    """Per rank, each kind and tag whose figure grew past the tolerance, with its slope and first cycle."""
    leaks: list[Leak] = []
    for s in series:
        tracker = DriftTracker(s.config)
        for _, epoch, state, device, host, rss in s.snapshots:
            tracker.add(epoch, state, figures_of(device, host, rss))
        leaks += [Leak(rank=s.rank, kind=f.kind, tag=f.tag, state=f.state, first_cycle=f.first_cycle,
                       bytes_per_cycle=f.bytes_per_cycle, slope=f.slope, grown=f.grown, baseline=f.baseline,
                       cycles=f.cycles, inside=f.inside, grew_with=dict(f.grew_with))
                  for f in tracker.findings()]  # fmt: skip
    return leaks


def unjudged_note(series: list[MemorySeries]) -> str | None:
    """The note a run too short to judge drift gets: its cycles against what its ``DriftConfig`` needs; else None."""
    short = [(s.rank, max(e for _, e, *_ in s.snapshots), s.config) for s in series if s.snapshots]
    short = [(rank, last, config) for rank, last, config in short if last < config.cycles_to_judge]
    if not short:
        return None
    ranks = ", ".join(str(rank) for rank, _, _ in short)
    last, config = max(last for _, last, _ in short), short[0][2]
    return (f"memory drift not judged on rank(s) {ranks}: the trace holds {last} cycle(s); sustained growth is judged "
            f"from cycle {config.cycles_to_judge} ({config.warmup_cycles} warm-up, a baseline, "
            f"{config.sustain_cycles} rises): a leak in this run could go unseen")  # fmt: skip


def _config(raw: Any) -> DriftConfig:
    if not isinstance(raw, dict):
        return DriftConfig()
    try:
        return DriftConfig(**{k: v for k, v in raw.items() if k in DriftConfig.__dataclass_fields__})
    except (ConfigError, TypeError):  # a config replay cannot rebuild: judge by the defaults
        return DriftConfig()


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _ints(raw: Any) -> dict[str, int]:
    return {str(k): v for k, v in raw.items() if _int(v) is not None} if isinstance(raw, dict) else {}


def leak_note(leaks: list[Leak]) -> str:
    """The note under the verdict: who leaks what (the details are the report's Leaks section)."""
    named = "; ".join(f"rank {k['rank']} {k['kind']} {k['tag']!r} +{_mib(k['bytes_per_cycle'])}/cycle" for k in leaks[:4])
    more = f"; and {len(leaks) - 4} more" if len(leaks) > 4 else ""
    return f"memory grows cycle by cycle: {named}{more} (exit 3; see Leaks)"


def leak_lines(leaks: list[Leak]) -> list[tuple[str | None, str]]:
    """The report's Leaks section: one line per rank, kind and tag."""
    if not leaks:
        return []
    lines: list[tuple[str | None, str]] = [("bold", f"\nLeaks ({len(leaks)})")]
    lines += [("red", f"  rank {k['rank']}: {k['kind']} memory under {k['tag']!r}{_outside(k)} at {k['state']} grows "
                      f"{_mib(k['bytes_per_cycle'])}/cycle from cycle {k['first_cycle']} (slope "
                      f"{_mib(round(k['slope']))}/cycle over {k['cycles']} cycles, +{_mib(k['grown'])} in all)"
                      f"{_held_by(k)}")
              for k in leaks]  # fmt: skip
    return lines


def _outside(k: Leak) -> str:
    return f" outside {k['inside']!r}" if k.get("inside") else ""


def _held_by(k: Leak) -> str:
    """The figures holding the one named that grew with it: they are not named for it (``INSIDE``)."""
    grew = k.get("grew_with") or {}
    if not grew:
        return ""
    return "; " + " and ".join(f"{tag!r} +{_mib(n)}" for tag, n in grew.items()) + " grew with it (they hold it)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
