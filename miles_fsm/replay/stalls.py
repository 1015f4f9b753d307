"""Ranks that stopped (crashed, stuck, unknown) and ranks that straggle.

Each stopped rank is described by ``miles_fsm.replay.stopped``.

Wall clocks are used only to say *for how long* a rank has been silent; the
report says they are an estimate. Used by ``miles_fsm.replay.diagnose``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from miles_fsm.replay.attempts import counted_all
from miles_fsm.replay.evidence import CORE_EVENTS
from miles_fsm.replay.model import FINISHED, RankTrace
from miles_fsm.replay.shapes import (
    Accusation,
    GuardFailure,
    LocatedFault,
    OutsideFailure,
    StepFailure,
    StoppedRank,
    Straggler,
)
from miles_fsm.replay.stopped import cut_off, stopped_entry
from miles_fsm.trace.schema import error_fields

_Kind = Literal["lost", "timeout"]
#: A failed collective's ``transport`` (judged by the writer) -> how it accuses the silent rank.
_TRANSPORT: dict[str, _Kind] = {"peer_lost": "lost", "timeout": "timeout"}
#: The lifecycle's own errors that accuse the ranks they name as ``missing``.
_ERRORS: dict[str, _Kind] = {"PeerLostError": "lost", "GuardTimeoutError": "timeout"}


def accusing_kind(transport: str | None, error: str | None) -> _Kind | None:
    """How a recorded failure accuses the ranks it names: ``lost``, ``timeout`` or None (it does not)."""
    return _TRANSPORT.get(transport or "") or _ERRORS.get(error or "")


def left_blaming_others(t: RankTrace) -> bool:
    """The rank closed its trace on an error of its own that names other ranks: it left because of them."""
    c = t.closed
    if c is None or c.get("clean") is True:
        return False
    fields = error_fields(c)
    named = set(c.get("culprits") or fields.get("culprits") or ()) | set(fields.get("missing") or ())
    return bool(named - {t.rank})


def located(traces: Sequence[RankTrace]) -> list[LocatedFault]:
    """Faults that a driver or the demo located itself: records of their own with a ``culprits`` list."""
    out: list[LocatedFault] = []
    for t in traces:
        for n in t.notes:
            culprits = n.record.get("culprits")
            if n.event in CORE_EVENTS or not isinstance(culprits, list) or not culprits:
                continue
            out.append(
                {
                    "rank": t.rank,
                    "event": n.event,
                    "position": n.position,
                    "epoch": n.record.get("epoch"),
                    "culprits": sorted(set(culprits)),
                    "error": n.record.get("error"),
                    "where": n.record.get("where"),
                }
            )
    return out


def accusations(
    traces: Sequence[RankTrace],
    guard_failures: list[GuardFailure],
    failures: list[StepFailure],
    located: list[LocatedFault],
    outside: list[OutsideFailure],
) -> dict[int, list[Accusation]]:
    """Who the surviving ranks' records blame for stopping, and how (lost connection, timeout, located)."""
    accused: dict[int, list[Accusation]] = defaultdict(list)
    for g in guard_failures:
        kind = _ERRORS.get(g["error"] or "")
        if kind is None:
            continue
        via = f"the guard of {g['transition']} (epoch {g['epoch']}, {g['error']})"
        for m in g["missing"]:
            accused[m].append({"kind": kind, "by": g["ranks"], "position": g["position"], "epoch": g["epoch"],
                               "transition": g["transition"], "via": via})
    # A collective that failed on some ranks and left another silent mid-transition: the silent one.
    silent = {t.rank: t.open.index for t in traces if t.open is not None}
    grouped: dict[tuple[int, _Kind], list[StepFailure]] = defaultdict(list)
    for f in failures:
        kind = _TRANSPORT.get(f["transport"] or "")
        if kind is not None:
            grouped[(f["position"], kind)].append(f)
    for (position, kind), fs in grouped.items():
        f = fs[0]
        by = sorted(x["rank"] for x in fs)
        via = f"the collective of {f['action']} in {f['transition']} (epoch {f['epoch']})"
        for r, at in silent.items():
            if at <= position and r not in by:
                accused[r].append({"kind": kind, "by": by, "position": position, "epoch": f["epoch"],
                                   "transition": f["transition"], "via": via})
    # A failure outside any transition that lost its peer or timed out: the ranks it names, else the cut-off ones.
    cut = [t.rank for t in traces if cut_off(t) and t.state != "FAILED"]
    for o in outside:
        kind = accusing_kind(o["transport"], o["error"])
        if kind is None:
            continue
        via = f"its {o['event']} record" + (f" ({o['where']})" if o["where"] else "")
        for r in o["culprits"] or cut:
            if r != o["rank"]:
                accused[r].append({"kind": kind, "by": [o["rank"]], "position": o["position"], "epoch": o["epoch"],
                                   "transition": o["where"], "via": via})
    for loc in located:
        for c in loc["culprits"]:
            if c != loc["rank"]:
                accused[c].append({"kind": "located", "by": [loc["rank"]], "position": loc["position"],
                                   "epoch": loc["epoch"], "transition": loc["where"],
                                   "via": f"its own {loc['event']} record"})
    # A rank that closed its trace on its own error naming other ranks left because of them: the lost
    # connection its peers then record is its exit, a consequence, never evidence against it.
    by_rank = {t.rank: t for t in traces}
    for r in list(accused):
        t = by_rank.get(r)
        if t is not None and left_blaming_others(t):
            accused[r] = [a for a in accused[r] if a["kind"] != "lost"]
            if not accused[r]:
                del accused[r]
    return accused


def stopped(
    traces: Sequence[RankTrace],
    by_rank: dict[int, RankTrace],
    missing: list[int],
    guard_failures: list[GuardFailure],
    accused: dict[int, list[Accusation]],
    last_wall: float | None,
) -> list[StoppedRank]:
    """Ranks that stopped while others needed them: accused by survivors, or ending open or behind."""
    # Ranks waiting at a guard when their trace ends, or failed at one: they wait on someone.
    waiting: dict[int, int] = {}
    for t in traces:
        if t.open is not None and t.open.phase == "guard":
            waiting[t.rank] = t.open.index
    for g in guard_failures:
        if g["error"] in ("GuardTimeoutError", "PeerLostError"):
            for r in g["ranks"]:
                waiting[r] = g["position"]
    wait_pos = max(waiting.values(), default=None)
    # Only accusations that could explain a stop: located faults alone name culprits of other kinds too,
    # unless the rank they name was cut off (its trace has no trace_closed).
    cut = {t.rank for t in traces if cut_off(t)}
    candidates = {r for r, acc in accused.items() if r in cut or any(a["kind"] != "located" for a in acc)}
    open_elsewhere = [t for t in traces if t.open is not None and t.open.phase != "guard"]
    # Every rank stopped at the same point: the job was stopped from outside, nobody is to blame.
    ends = {t.open.index for t in open_elsewhere if t.open is not None}
    everyone = len(open_elsewhere) == len(traces) and len(ends) == 1
    for t in traces:
        if t.open is not None and t.open.phase != "guard" and not everyone:
            candidates.add(t.rank)
        elif wait_pos is not None and t.positions <= wait_pos and t.rank not in waiting and t.state != "FAILED":
            candidates.add(t.rank)
    if waiting:
        candidates.update(missing)
    # The run's own bound on waiting: silence within it is what a live run's slow step looks like.
    bound = max((t.guard_timeout_s for t in traces if t.guard_timeout_s is not None), default=None)
    return [
        stopped_entry(
            r, by_rank.get(r), accused.get(r, []), sorted(w for w in waiting if w != r), traces, last_wall,
            unread=r not in by_rank and r not in missing, bound=bound,
        )
        for r in sorted(candidates)
    ]


# -------------------------------------------------------------- stragglers


def stragglers(traces: Sequence[RankTrace], ratio: float, floor_s: float) -> list[Straggler]:
    """Per trigger: the rank with the most own work time (guard wait excluded) against the median."""
    import numpy as np

    traces = [t for t in counted_all(traces) if t.positions]
    if len(traces) < 2:
        return []
    width = max(t.positions for t in traces)
    work = np.full((len(traces), width), np.nan)
    for i, t in enumerate(traces):
        row = np.frombuffer(t.work_s, dtype=np.float64)
        ok = np.frombuffer(bytes(t.outcome), dtype=np.uint8) == FINISHED[0]
        work[i, : t.positions] = np.where(ok, row, np.nan)
    ref = max(traces, key=lambda t: t.positions)
    triggers = np.array([ref.trigger_at(j) for j in range(ref.positions)], dtype=object)
    ranks = np.array([t.rank for t in traces])
    out: list[Straggler] = []
    for trig in dict.fromkeys(triggers.tolist()):
        cols = np.nonzero(triggers == trig)[0]
        sub = work[:, cols]
        counted = ~np.isnan(sub)
        if not counted.any():
            continue
        totals = np.where(counted, sub, 0.0).sum(axis=1)
        has = counted.any(axis=1)
        med = float(np.median(totals[has]))
        slow = int(np.argmax(np.where(has, totals, -np.inf)))
        entry: Straggler = {
            "transition": trig,
            "instances": int(len(cols)),
            "slowest_rank": int(ranks[slow]),
            "slowest_s": float(totals[slow]),
            "median_s": med,
            "ratio": float(totals[slow] / med) if med > 0 else None,
        }
        live = counted.any(axis=0)  # columns some rank finished (nanmedian warns on the others)
        cols, sub, counted = cols[live], sub[:, live], counted[:, live]
        col_med = np.nanmedian(sub, axis=0)
        col_max = np.max(np.where(counted, sub, -np.inf), axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            col_ratio = np.where(col_med > 0, col_max / col_med, np.nan)
        if not np.all(np.isnan(col_ratio)):
            k = int(np.nanargmax(col_ratio))
            who = int(np.argmax(np.where(counted[:, k], sub[:, k], -np.inf)))
            entry["worst"] = {
                "epoch": int(ref.epochs[cols[k]]),
                "rank": int(ranks[who]),
                "seconds": float(col_max[k]),
                "median_s": float(col_med[k]),
                "ratio": float(col_ratio[k]),
            }
        entry["straggler"] = bool(
            entry["ratio"] is not None and entry["ratio"] >= ratio and totals[slow] - med >= floor_s
        )
        out.append(entry)
    return out


