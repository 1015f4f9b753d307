"""The bounds ``gpu_drift.py`` holds a leak run to (issue 37), as plain functions on its JSON, tested on CPU.

A leak run keeps one buffer per cycle in a plain list from cycle ``start`` on,
untagged, as a user's code would. It passes when:

- the live check named it within 4 cycles of its start (at cycle
  ``start + 3`` at the latest), by a figure that really grew (``EXPECTED``) and
  by no other;
- it named it once: by one figure, the innermost that holds it
  (``HELD_IN[kind][0]``) where the run's snapshots have that figure. The
  figures that hold it (``miles_fsm.memory_drift.INSIDE``) grew with it, and
  are judged on their growth outside it;
- every figure it was named by has a slope within 15% of the true bytes per
  cycle, in the live finding and in replay's (refitted over the whole run);
- replay names the same figures, on rank 0, and exits 3.

A healthy run passes with no finding at all, live or in replay.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXPECTED", "HELD_IN", "SLOPE_REL", "WITHIN_CYCLES", "check_healthy", "check_leak"]

#: The figures a leak of each kind grows: device memory kept by a tensor; page-locked host memory, touched.
EXPECTED: dict[str, frozenset[tuple[str, str]]] = {
    "device": frozenset({("device", "in_use"), ("device", "torch:allocated"), ("device", "torch:reserved")}),
    "pinned": frozenset({("host", "torch:pinned"), ("rss", "process")}),
}
#: Per leak kind, the figures that hold it, innermost first: the first that a run's snapshots have names it.
HELD_IN: dict[str, tuple[tuple[str, str], ...]] = {
    "device": (("device", "torch:allocated"), ("device", "torch:reserved"), ("device", "in_use")),
    "pinned": (("host", "torch:pinned"), ("rss", "process")),
}
#: Named within this many cycles of the leak's start (its first cycle counted).
WITHIN_CYCLES = 4
#: A named figure's slope is within this part of the true bytes per cycle.
SLOPE_REL = 0.15


def _within(slope: float, truth: int) -> bool:
    return abs(slope - truth) <= SLOPE_REL * truth


def check_leak(run: dict[str, Any], *, kind: str, per_cycle: int, start: int) -> list[str]:
    """What a leak run of ``kind`` got wrong against the goal's bounds (empty: it passed)."""
    expected = EXPECTED[kind]
    failed = []
    live = run.get("warnings") or []
    named = {(w["kind"], w["tag"]) for w in live}
    if not named & expected:
        failed.append(f"{kind} leak: the live check never named it by {sorted(expected)}: {live}")
    if named - expected:
        failed.append(f"{kind} leak: named by figures that did not grow with it: {sorted(named - expected)}")
    failed += _named_once(run, kind, named & expected)
    first = min((w["named_at"] for w in live if (w["kind"], w["tag"]) in expected), default=None)
    if first is not None and first > start + WITHIN_CYCLES - 1:
        failed.append(f"{kind} leak from cycle {start}: first named at cycle {first}, past {start + WITHIN_CYCLES - 1}")
    for w in live:
        if (w["kind"], w["tag"]) in expected and not _within(w["slope"], per_cycle):
            failed.append(f"{kind} leak: live slope of {w['kind']} {w['tag']!r} {w['slope']:.0f} B/cycle, "
                          f"not within 15% of {per_cycle}")  # fmt: skip
    replay = run.get("replay") or {}
    leaks = replay.get("leaks") or []
    if {(k["kind"], k["tag"]) for k in leaks if k["rank"] == 0} != named or any(k["rank"] != 0 for k in leaks):
        failed.append(f"{kind} leak: replay named {[(k['rank'], k['kind'], k['tag']) for k in leaks]}, "
                      f"the live check {sorted(named)}")  # fmt: skip
    for k in leaks:
        if (k["kind"], k["tag"]) in expected and not _within(k["slope"], per_cycle):
            failed.append(f"{kind} leak: replay's slope of {k['kind']} {k['tag']!r} {k['slope']:.0f} B/cycle, "
                          f"not within 15% of {per_cycle}")  # fmt: skip
    if replay.get("exit_code") != 3:
        failed.append(f"{kind} leak: replay exited {replay.get('exit_code')}, not 3")
    return failed


def _has(snapshot: Any, figure: tuple[str, str]) -> bool:
    kind, tag = figure
    if not isinstance(snapshot, dict):
        return False
    return snapshot.get("rss") is not None if kind == "rss" else tag in (snapshot.get(kind) or {})


def _named_once(run: dict[str, Any], kind: str, named: set[tuple[str, str]]) -> list[str]:
    """The leak named once, by the innermost figure holding it that the run's snapshots have."""
    if len(named) > 1:
        return [f"{kind} leak: named {len(named)} times, by {sorted(named)}: once, by the innermost, is right"]
    snapshots = (run.get("replay") or {}).get("training_snapshots") or []
    innermost = next((f for f in HELD_IN[kind] if any(_has(s, f) for s in snapshots)), None)
    if named and innermost is not None and named != {innermost}:
        return [f"{kind} leak: named by {sorted(named)}, not by {innermost}, which holds it and the snapshots have"]
    return []


def check_healthy(run: dict[str, Any], *, strategy: str) -> list[str]:
    """What a healthy run got wrong: any finding is a false positive."""
    failed = []
    if run.get("false_positive") is not None:
        failed.append(f"false positive under {strategy}: {run['false_positive']}")
    if run.get("warnings"):
        failed.append(f"warnings under {strategy}: {run['warnings']}")
    leaks = (run.get("replay") or {}).get("leaks")
    if leaks:
        failed.append(f"replay found leaks under {strategy}: {leaks}")
    if run.get("cycles_done") != run.get("cycles"):
        failed.append(f"{strategy}: {run.get('cycles_done')} of {run.get('cycles')} cycles ran")
    return failed
