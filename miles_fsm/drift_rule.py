"""When one figure's per-cycle values are drift, and how fast they grow (docs/memory-drift.md#the-rule).

Pure arithmetic on (cycle, bytes) points of one figure at one state, shared by
the live check and replay through ``miles_fsm.memory_drift.DriftTracker``.

Two inputs, either one is drift:

- **sustained growth**: the figure rose in each of the last
  ``DriftConfig.sustain_cycles`` steps, and over its growth run (the longest
  stretch, ending now, in which it never fell) it grew by ``abs_bytes`` or
  more, by its raw values and by its robust slope times the run's length. The
  size of the figure plays no part: a 64 MiB/cycle leak on an 8 GiB RSS is
  drift as soon as on a 100 MiB one. A one-off step (a lazy buffer) is not a
  run: the robust slope of a step is ~0, and its later steps do not rise;
- **threshold** (the rule before it, kept): the figure stands more than
  ``abs_bytes + rel * baseline`` above its baseline, judged from
  ``sustain_cycles`` cycles past the baseline on (as growth is, so a slope is
  never fitted over two or three points). ``rel`` absorbs noise on small
  figures; on large ones this input is inert and growth is the rule.

The slope is Siegel's repeated median over the run's points (the point just
before the first rise included: a leak that began after the baseline lies on
one line with it). A single outlier cycle (an allocator growing a segment
once) does not move it, where least squares over two or three points takes
the outlier whole.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from miles_fsm.config import DriftConfig

__all__ = ["FIT_POINTS", "Judgement", "judge", "repeated_median_slope", "sustained_start"]

#: Points kept per figure and fitted at most: the slope of the last 64 cycles, at O(64^2) per fit.
FIT_POINTS = 64

Point = tuple[int, int]


def repeated_median_slope(points: Sequence[Point]) -> float:
    """Siegel's repeated-median slope (bytes per cycle): per point the median slope to the others, then their median."""
    per_point = []
    for i, (xi, yi) in enumerate(points):
        slopes = [(yj - yi) / (xj - xi) for j, (xj, yj) in enumerate(points) if j != i and xj != xi]
        if slopes:
            per_point.append(median(slopes))
    return float(median(per_point)) if per_point else 0.0


def run_start(points: Sequence[Point]) -> int:
    """Index of the first point of the growth run: the longest stretch ending at the last point that never fell."""
    i = len(points) - 1
    while i > 0 and points[i][1] >= points[i - 1][1]:
        i -= 1
    return i


def rising_steps(points: Sequence[Point]) -> int:
    """How many of the last steps rose, one after the other (0 when the last one did not)."""
    n = 0
    for i in range(len(points) - 1, 0, -1):
        if points[i][1] <= points[i - 1][1]:
            break
        n += 1
    return n


def sustained_start(points: Sequence[Point], config: DriftConfig) -> int | None:
    """Where sustained growth that is drift now begins (an index into ``points``), or None.

    Over the growth run's last ``m`` steps, for the fewest ``m >= sustain_cycles`` that
    qualify: the figure grew ``abs_bytes`` by its values and by its median per-cycle step
    times their cycles. The fewest, so that the flat cycles before a leak (a figure
    constant for 20 cycles never fell either) neither dilute its median step nor its slope.
    """
    k = config.sustain_cycles
    if rising_steps(points) < k:
        return None
    last = len(points) - 1
    rates: list[float] = []  # the per-cycle steps from point i on, kept sorted: the median costs nothing
    for i in range(last - 1, run_start(points) - 1, -1):
        (c0, y0), (ca, a), (c1, y1) = points[i], points[i + 1], points[last]
        insort(rates, (a - y0) / (ca - c0))
        if last - i < k or y1 - y0 < config.abs_bytes:
            continue
        m = len(rates)
        typical = rates[m // 2] if m % 2 else (rates[m // 2 - 1] + rates[m // 2]) / 2
        if typical * (c1 - c0) >= config.abs_bytes:
            return i
    return None


@dataclass(frozen=True, slots=True)
class Judgement:
    """A figure found drifting: by which input, from which point its growth is fitted, at what slope."""

    rule: str  # "sustained" or "threshold"
    start: int  # index (into the points judged) of the first point the slope is fitted over
    slope: float


def judge(points: Sequence[Point], baseline: int, config: DriftConfig, *, size: int | None = None) -> Judgement | None:
    """Whether ``points`` (one figure at one state, in cycle order, since ``baseline``'s cycle) are drift now.

    ``size``: what the threshold's relative tolerance scales with, where the points are not the figure
    itself but its growth outside a figure it holds (``miles_fsm.memory_drift.INSIDE``); else ``baseline``.
    """
    points = list(points)
    if len(points) < 2:
        return None
    last = points[-1][1]
    k = config.sustain_cycles
    start = sustained_start(points, config)
    if start is not None:
        return Judgement("sustained", start, repeated_median_slope(points[start:][-FIT_POINTS:]))
    # Judged once the figure has sustain_cycles cycles past its baseline, as growth is: over two or three
    # points an allocator's one-off segment is half the slope (248 MB/cycle for a 134 MB leak on an H100).
    if len(points) > k and last - baseline > config.tolerance(baseline if size is None else size):
        # Fitted from where its latest rises began (not over the flat cycles before them), else since the baseline.
        rises = rising_steps(points)
        start = len(points) - 1 - rises if rises else 0
        return Judgement("threshold", start, repeated_median_slope(points[start:][-FIT_POINTS:]))
    return None
