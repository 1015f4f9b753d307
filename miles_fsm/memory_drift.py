"""Per-cycle memory drift: the figures of one state compared across cycles (docs/memory-drift.md).

Pure arithmetic on snapshots, shared by the live check (``miles_fsm.states.drift``)
and replay (``miles_fsm.replay.leaks``), so both judge a run alike. A figure is
keyed by the state it was taken at, its kind (``device``, ``host``, ``rss``) and
its tag (``rss``'s is ``process``). Cycles up to ``DriftConfig.warmup_cycles``
are not judged (allocator caches, pools and lazy buffers settle there); the
first cycle after them is the baseline. A figure that then stands more than the
tolerance above its baseline is drift, reported once per kind and tag.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from miles_fsm.config import DriftConfig

__all__ = ["KINDS", "DriftFinding", "DriftTracker", "figures_of"]

#: The kinds of figure, in the order a snapshot is judged: a tagged figure names its tag before the RSS does.
KINDS = ("device", "host", "rss")


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One figure that grew: where, from when, and how fast (``slope``: least squares, bytes per cycle)."""

    kind: str
    tag: str
    state: str
    first_cycle: int
    baseline: int
    grown: int
    bytes_per_cycle: int
    slope: float
    cycles: int


@dataclass(slots=True)
class _Series:
    """One figure over cycles; sums kept as Python ints, so the fit is exact at any length."""

    base_cycle: int
    baseline: int
    last_cycle: int = 0
    last: int = 0
    first_cycle: int | None = None
    n: int = 0
    sx: int = 0
    sy: int = 0
    sxx: int = 0
    sxy: int = 0

    def add(self, cycle: int, value: int) -> None:
        if cycle == self.last_cycle and self.n:  # a state seen twice in one cycle (a recovery): the later counts
            self._sum(cycle, self.last, -1)
        self._sum(cycle, value, 1)
        self.last_cycle, self.last = cycle, value
        if self.first_cycle is None and value > self.baseline:
            self.first_cycle = cycle

    def _sum(self, x: int, y: int, sign: int) -> None:
        self.n += sign
        self.sx += sign * x
        self.sy += sign * y
        self.sxx += sign * x * x
        self.sxy += sign * x * y

    @property
    def slope(self) -> float:
        den = self.n * self.sxx - self.sx * self.sx
        return (self.n * self.sxy - self.sx * self.sy) / den if den else 0.0


class DriftTracker:
    """Feeds snapshots in cycle order; returns the drift each one reveals, once per kind and tag."""

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._found: dict[tuple[str, str], tuple[str, str, str]] = {}

    def add(self, cycle: int, state: str, figures: Iterable[tuple[str, str, int]]) -> list[DriftFinding]:
        """Take one snapshot: ``figures`` are (kind, tag, bytes). Returns the drift newly found in it."""
        if cycle <= self.config.warmup_cycles:
            return []
        found = []
        for kind, tag, value in figures:
            key = (state, kind, tag)
            series = self._series.get(key)
            if series is None:
                self._series[key] = series = _Series(base_cycle=cycle, baseline=value)
            series.add(cycle, value)
            if (kind, tag) in self._found or value - series.baseline <= self.config.tolerance(series.baseline):
                continue
            self._found[(kind, tag)] = key
            found.append(self._finding(key, series))
        return found

    def findings(self) -> list[DriftFinding]:
        """Every drift found so far, its slope fitted over all cycles seen since its baseline."""
        return [self._finding(key, self._series[key]) for key in self._found.values()]

    @staticmethod
    def _finding(key: tuple[str, str, str], s: _Series) -> DriftFinding:
        state, kind, tag = key
        grown = s.last - s.baseline
        span = s.last_cycle - s.base_cycle
        return DriftFinding(kind=kind, tag=tag, state=state, first_cycle=s.first_cycle or s.last_cycle,
                            baseline=s.baseline, grown=grown, bytes_per_cycle=grown // span if span else grown,
                            slope=s.slope, cycles=s.n)  # fmt: skip


def figures_of(device: Mapping[str, int] | None, host: Mapping[str, int] | None,
               rss: int | None) -> list[tuple[str, str, int]]:  # fmt: skip
    """A snapshot's figures as (kind, tag, bytes), in judging order; unknown ones left out."""
    out = [("device", tag, int(v)) for tag, v in sorted((device or {}).items()) if v is not None]
    out += [("host", tag, int(v)) for tag, v in sorted((host or {}).items()) if v is not None]
    if rss is not None:
        out.append(("rss", "process", int(rss)))
    return out
