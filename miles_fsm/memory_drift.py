"""Per-cycle memory drift: the figures of one state compared across cycles (docs/memory-drift.md).

Pure arithmetic on snapshots, shared by the live check (``miles_fsm.states.drift``)
and replay (``miles_fsm.replay.leaks``), so both judge a run alike. A figure is
keyed by the state it was taken at, its kind (``device``, ``host``, ``rss``) and
its tag (``rss``'s is ``process``). Cycles up to ``DriftConfig.warmup_cycles``
are not judged (allocator caches, pools and lazy buffers settle there); the
first cycle after them is the baseline. ``miles_fsm.drift_rule`` says when a
figure's points are drift (sustained growth, or past the threshold); each kind
and tag is reported once.

Some figures hold others whole (``INSIDE``): the device in use (the whole
device) holds torch's reserved bytes, which hold its allocated bytes; the RSS
holds torch's pinned host bytes. Where a snapshot has the figure inside, the
outer one is judged only on the growth that the inner does not explain
(``in_use - torch:reserved``): a leak is named once, by the innermost figure that
grew, and the finding says which outer figures grew with it (``grew_with``).
A user's CUDA tensor is ``torch:allocated``; allocator cache growth with no
allocation growth ``torch:reserved``; device memory outside torch's allocator
(another library's ``cudaMalloc``, NCCL, another process) ``in_use``. Where the
inner figure is absent (CPU, CUDA not initialized), the outer is judged whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from miles_fsm.config import DriftConfig
from miles_fsm.drift_rule import FIT_POINTS, judge, repeated_median_slope

__all__ = ["INSIDE", "KINDS", "DriftFinding", "DriftTracker", "figures_of"]

#: The kinds of figure, in the order a snapshot is judged: a tagged figure names its tag before the RSS does.
KINDS = ("device", "host", "rss")

Figure = tuple[str, str]  # (kind, tag)
_Key = tuple[str, str, str, str | None]  # (state, kind, tag, the tag of the figure inside it, if judged less it)

#: An outer figure -> the figure it holds whole, in the same process and snapshot: the outer is judged on
#: (outer - inner) where the snapshot has the inner. 1 GiB of ``pin_memory=True`` raised the RSS by 1025 MiB
#: on an H100; torch_memory_saver's regions go through torch's allocator, which counts them (measured with
#: hook_mode="torch": at OFFLOADED the device in use stood below torch:allocated by what was paused).
INSIDE: Mapping[Figure, Figure] = MappingProxyType({
    ("device", "in_use"): ("device", "torch:reserved"),
    ("device", "torch:reserved"): ("device", "torch:allocated"),
    ("rss", "process"): ("host", "torch:pinned"),
})


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One figure that grew: where, from when, and how fast (``slope``: repeated median, bytes per cycle).

    ``baseline`` and ``grown``: the figure at its baseline, and its growth since; ``bytes_per_cycle``
    and ``slope``: over the ``cycles`` points since its growth began (the run's start, or the baseline).
    ``inside``: the tag of the figure inside this one whose growth was taken out (``in_use`` judged as
    ``in_use - torch:reserved``), None when judged whole; ``baseline``, ``grown`` and the slopes are then of
    that difference. ``grew_with``: (tag, bytes) of each figure holding this one that grew with it over the
    same cycles (by half its growth or more): the leak is theirs too, but named here.
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
    inside: str | None = None
    grew_with: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class _Series:
    """One figure at one state over cycles: its baseline and last ``FIT_POINTS`` points, as judged and raw.

    Judged: the figure less the one inside it (``INSIDE``) where the series is keyed with it, else the
    figure. ``size``: the raw figure at the baseline, which the threshold's relative tolerance scales with.
    """

    baseline: int
    size: int
    points: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=FIT_POINTS))
    raw: dict[int, int] = field(default_factory=dict)  # cycle -> the raw figure, for the figures it holds
    fit_from: int | None = None  # once found: the cycle its growth is fitted from

    def add(self, cycle: int, value: int, raw: int) -> bool:
        """Take the figure at ``cycle``; False (and nothing kept) for a cycle older than the last one."""
        if self.points and cycle < self.points[-1][0]:  # a damaged or hostile trace: cycles never go back
            return False
        # A state seen twice in one cycle (a recovery): the later counts.
        if self.points and self.points[-1][0] == cycle:
            self.points.pop()
        self.points.append((cycle, value))
        self.raw[cycle] = raw
        if len(self.raw) > FIT_POINTS:
            del self.raw[next(iter(self.raw))]
        return True


class DriftTracker:
    """Feeds snapshots in cycle order; returns the drift each one reveals, once per kind and tag."""

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        # Keyed (state, kind, tag, the tag inside it or None): a figure judged less its inner figure is a
        # series of its own, so an inner figure that appears mid-run (CUDA initialized late) starts one afresh.
        self._series: dict[_Key, _Series] = {}
        self._found: dict[Figure, _Key] = {}
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
        figures = list(figures)
        values = {(kind, tag): value for kind, tag, value in figures}
        taken = []  # every figure is taken before any is judged: a finding says what its outer figures did
        for kind, tag, value in figures:
            inner = INSIDE.get((kind, tag))
            held = values.get(inner) if inner is not None else None
            key = (state, kind, tag, None if inner is None or held is None else inner[1])
            judged = value if held is None else value - held
            series = self._series.get(key)
            if series is None:
                self._series[key] = series = _Series(baseline=judged, size=value)
            if series.add(cycle, judged, value) and (kind, tag) not in self._found:
                taken.append((key, series))
        found = []
        for key, series in taken:
            judgement = judge(series.points, series.baseline, self.config, size=series.size)
            if judgement is None:
                continue
            series.fit_from = series.points[judgement.start][0]
            self._found[key[1:3]] = key
            found.append(self._finding(key))
        return found

    def findings(self) -> list[DriftFinding]:
        """Every drift found so far, its slope refitted over every cycle since its growth began."""
        return [self._finding(key) for key in self._found.values()]

    def _finding(self, key: _Key) -> DriftFinding:
        state, kind, tag, inside = key
        s = self._series[key]
        fit = [p for p in s.points if p[0] >= (s.fit_from or 0)]
        (c0, y0), (c1, y1) = fit[0], fit[-1]
        first = next((c for c, y in fit if y > y0), c1)  # the growth's first cycle: the first above the fit's start
        span = c1 - c0
        return DriftFinding(kind=kind, tag=tag, state=state, first_cycle=first, baseline=s.baseline,
                            grown=y1 - s.baseline, bytes_per_cycle=(y1 - y0) // span if span else y1 - y0,
                            slope=repeated_median_slope(fit), cycles=len(fit), inside=inside,
                            grew_with=self._grew_with(state, (kind, tag), c0, c1, y1 - y0))  # fmt: skip

    def _grew_with(self, state: str, figure: Figure, c0: int, c1: int, grown: int) -> tuple[tuple[str, int], ...]:
        """The figures holding ``figure`` (outward) that grew by half its ``grown`` or more from cycle c0 to c1."""
        out = []
        while (outer := next((o for o, i in INSIDE.items() if i == figure), None)) is not None:
            s = self._series.get((state, *outer, figure[1]))
            if s is None or c0 not in s.raw or c1 not in s.raw:
                break  # not held in these snapshots: nor by what holds it
            if 2 * (s.raw[c1] - s.raw[c0]) >= grown > 0:
                out.append((outer[1], s.raw[c1] - s.raw[c0]))
            figure = outer
        return tuple(out)


def figures_of(device: Mapping[str, int] | None, host: Mapping[str, int] | None,
               rss: int | None) -> list[tuple[str, str, int]]:  # fmt: skip
    """A snapshot's figures as (kind, tag, bytes), in judging order; unknown ones left out."""
    out = [("device", tag, int(v)) for tag, v in sorted((device or {}).items()) if v is not None]
    out += [("host", tag, int(v)) for tag, v in sorted((host or {}).items()) if v is not None]
    if rss is not None:
        out.append(("rss", "process", int(rss)))
    return out
