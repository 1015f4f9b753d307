"""Per-cycle memory drift: the figures of one state compared across cycles (docs/memory-drift.md).

Pure arithmetic on snapshots, shared by the live check (``miles_fsm.states.drift``)
and replay (``miles_fsm.replay.leaks``), so both judge a run alike. A figure is
keyed by the state it was taken at, its kind (``device``, ``host``, ``rss``) and
its tag (``rss``'s is ``process``). Cycles up to ``DriftConfig.warmup_cycles``
are not judged (allocator caches, pools and lazy buffers settle there); the
first cycle after them is the baseline. ``miles_fsm.drift_rule`` says when a
figure's points are drift (sustained growth, or past the threshold); each kind
and tag is reported once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from miles_fsm.config import DriftConfig
from miles_fsm.drift_rule import FIT_POINTS, judge, repeated_median_slope

__all__ = ["KINDS", "DriftFinding", "DriftTracker", "figures_of"]

#: The kinds of figure, in the order a snapshot is judged: a tagged figure names its tag before the RSS does.
KINDS = ("device", "host", "rss")


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One figure that grew: where, from when, and how fast (``slope``: repeated median, bytes per cycle).

    ``baseline`` and ``grown``: the figure at its baseline, and its growth since; ``bytes_per_cycle``
    and ``slope``: over the ``cycles`` points since its growth began (the run's start, or the baseline).
    """

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
    """One figure at one state over cycles: its baseline and its last ``FIT_POINTS`` points."""

    baseline: int
    points: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=FIT_POINTS))
    fit_from: int | None = None  # once found: the cycle its growth is fitted from

    def add(self, cycle: int, value: int) -> bool:
        """Take the figure at ``cycle``; False (and nothing kept) for a cycle older than the last one."""
        if self.points and cycle < self.points[-1][0]:  # a damaged or hostile trace: cycles never go back
            return False
        # A state seen twice in one cycle (a recovery): the later counts.
        if self.points and self.points[-1][0] == cycle:
            self.points.pop()
        self.points.append((cycle, value))
        return True


class DriftTracker:
    """Feeds snapshots in cycle order; returns the drift each one reveals, once per kind and tag."""

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._found: dict[tuple[str, str], tuple[str, str, str]] = {}
        #: The last cycle seen (warm-up included): how far the run got, for ``judged``.
        self.last_cycle = 0

    @property
    def judged(self) -> bool:
        """Whether the run got far enough for sustained growth to be judged (``DriftConfig.cycles_to_judge``)."""
        return self.last_cycle >= self.config.cycles_to_judge

    def add(self, cycle: int, state: str, figures: Iterable[tuple[str, str, int]]) -> list[DriftFinding]:
        """Take one snapshot: ``figures`` are (kind, tag, bytes). Returns the drift newly found in it."""
        self.last_cycle = max(self.last_cycle, cycle)
        if cycle <= self.config.warmup_cycles:
            return []
        found = []
        for kind, tag, value in figures:
            key = (state, kind, tag)
            series = self._series.get(key)
            if series is None:
                self._series[key] = series = _Series(baseline=value)
            if not series.add(cycle, value) or (kind, tag) in self._found:
                continue
            judgement = judge(series.points, series.baseline, self.config)
            if judgement is None:
                continue
            series.fit_from = series.points[judgement.start][0]
            self._found[(kind, tag)] = key
            found.append(self._finding(key, series))
        return found

    def findings(self) -> list[DriftFinding]:
        """Every drift found so far, its slope refitted over every cycle since its growth began."""
        return [self._finding(key, self._series[key]) for key in self._found.values()]

    @staticmethod
    def _finding(key: tuple[str, str, str], s: _Series) -> DriftFinding:
        state, kind, tag = key
        fit = [p for p in s.points if p[0] >= (s.fit_from or 0)]
        (c0, y0), (c1, y1) = fit[0], fit[-1]
        first = next((c for c, y in fit if y > y0), c1)  # the growth's first cycle: the first above the fit's start
        span = c1 - c0
        return DriftFinding(kind=kind, tag=tag, state=state, first_cycle=first, baseline=s.baseline,
                            grown=y1 - s.baseline, bytes_per_cycle=(y1 - y0) // span if span else y1 - y0,
                            slope=repeated_median_slope(fit), cycles=len(fit))  # fmt: skip


def figures_of(device: Mapping[str, int] | None, host: Mapping[str, int] | None,
               rss: int | None) -> list[tuple[str, str, int]]:  # fmt: skip
    """A snapshot's figures as (kind, tag, bytes), in judging order; unknown ones left out."""
    out = [("device", tag, int(v)) for tag, v in sorted((device or {}).items()) if v is not None]
    out += [("host", tag, int(v)) for tag, v in sorted((host or {}).items()) if v is not None]
    if rss is not None:
        out.append(("rss", "process", int(rss)))
    return out
