"""Where ranks' traces first disagree: the first transition whose plan or guard differs.

Ranks are aligned by position (the n-th transition each one started), never
by wall time. Used by ``miles_fsm.diagnosis``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from miles_fsm.ranks import plural_ranks
from miles_fsm.schema import GUARD_FAILED, error_fields
from miles_fsm.trace_model import RankTrace

#: Intent fields, in the order a divergence names the first that differs.
_FIELDS = (
    "trigger",
    "epoch",
    "source state",
    "destination",
    "steps",
    "guarded",
    "tensors",
    "collectives",
    "plan fingerprint",
)
_GUARD_FIELDS = frozenset(("guarded", "collectives", "tensors", "plan fingerprint"))

def _global(traces: Sequence[RankTrace]) -> tuple[list[Any], list[Any]]:
    """Per rank, sig and guard ids in one id space shared by all ranks."""
    sig_ids: dict[Any, int] = {}
    guard_ids: dict[Any, int] = {}
    sigs, guards = [], []
    ref = traces[0]
    for t in traces:
        if t.sig_table == ref.sig_table and t is not ref:
            sigs.append(t.sigs)
        else:
            m = [sig_ids.setdefault(s, len(sig_ids)) for s in t.sig_table]
            sigs.append(t.sigs if m == list(range(len(m))) else [m[i] for i in t.sigs])
        if t.guard_table == ref.guard_table and t is not ref:
            guards.append(t.guards)
        else:
            m = [guard_ids.setdefault(g, len(guard_ids)) for g in t.guard_table]
            guards.append(t.guards if m == list(range(len(m))) else [-1 if i < 0 else m[i] for i in t.guards])
    return sigs, guards


def _first_mismatch(t: RankTrace, sig: Any, guard: Any, r: RankTrace, rsig: Any, rguard: Any) -> int | None:
    n = min(t.positions, r.positions)
    if n == 0:
        return None
    # The last compared position may still be planning (guard unknown): compare it apart.
    if t.epochs[: n - 1] == r.epochs[: n - 1] and sig[: n - 1] == rsig[: n - 1] and guard[: n - 1] == rguard[: n - 1]:
        i = n - 1
        a, b = guard[i], rguard[i]
        if t.epochs[i] == r.epochs[i] and sig[i] == rsig[i] and (a == b or a < 0 or b < 0):
            return None
        return i
    for i in range(n):
        a, b = guard[i], rguard[i]
        if t.epochs[i] != r.epochs[i] or sig[i] != rsig[i] or (a != b and a >= 0 and b >= 0):
            return i
    return None  # pragma: no cover - the slices differed


def first_divergence(traces: Sequence[RankTrace]) -> dict[str, Any] | None:
    traces = [t for t in traces if t.positions]
    if len(traces) < 2:
        return None
    sigs, guards = _global(traces)
    ref_i = max(range(len(traces)), key=lambda i: (traces[i].positions, -traces[i].rank))
    ref = traces[ref_i]
    first: int | None = None
    for i, t in enumerate(traces):
        if i == ref_i:
            continue
        j = _first_mismatch(t, sigs[i], guards[i], ref, sigs[ref_i], guards[ref_i])
        if j is not None and (first is None or j < first):
            first = j
    if first is None:
        return None
    at = {t.rank: t.describe_at(first) for t in traces if t.positions > first}
    for name in _FIELDS:
        values = {r: d[name] for r, d in at.items() if not (name in _GUARD_FIELDS and d["guarded"] is None)}
        if len({_key(v) for v in values.values()}) > 1:
            break
    else:  # pragma: no cover - ids differ only when some field does
        return None
    groups: dict[str, list[int]] = defaultdict(list)
    shown: dict[str, Any] = {}
    for r, v in sorted(values.items()):
        k = _key(v)
        groups[k].append(r)
        shown[k] = v
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    majority = ordered[0][1]
    tie = len(ordered) > 1 and len(ordered[1][1]) == len(majority)
    culprits = sorted(r for _, rs in ordered[1:] for r in rs)
    maj = at[majority[0]]
    not_reached = sorted(r for r, d in at.items() if r not in values)
    behind = sorted(t.rank for t in traces if t.positions <= first)
    groups_json = [{"ranks": rs, "value": shown[k]} for k, rs in ordered]
    others = ", ".join(f"{plural_ranks(rs)} {_show(shown[k])}" for k, rs in ordered[1:])
    also = [
        n
        for n in _FIELDS[_FIELDS.index(name) + 1 :]
        if len({_key(d[n]) for d in at.values() if not (n in _GUARD_FIELDS and d["guarded"] is None)}) > 1
    ]
    guard = _guard_report(traces, first)
    summary = (
        f"ranks disagree on {name} at {maj['trigger']} (epoch {maj['epoch']}): "
        f"{plural_ranks(majority)} {_show(shown[ordered[0][0]])}; {others}"
    )
    if guard is not None and guard["detail"]:
        summary += f" (the guard: {'; '.join(guard['detail'])})"
    return {
        "position": first,
        "epoch": maj["epoch"],
        "transition": maj["trigger"],
        "field": name,
        "also_differ": also,
        "groups": groups_json,
        "guard_report": guard,
        "culprits": culprits,
        "tie": tie,
        "not_yet_at_guard": not_reached,
        "not_there": behind,
        "summary": summary,
    }


def _guard_report(traces: Sequence[RankTrace], position: int) -> dict[str, Any] | None:
    """What the guard itself said at this position, if it caught the divergence (its field and detail)."""
    for t in traces:
        for n in t.notes:
            if n.position == position and n.event == GUARD_FAILED and n.record.get("error") == "RankDivergenceError":
                fields = error_fields(n.record)
                detail = [d for d in str(fields.get("detail") or "").split("; ") if d]
                return {"field": fields.get("field"), "groups": fields.get("groups"),
                        "culprits": fields.get("culprits"), "detail": detail, "rank": t.rank}
    return None


def _key(v: Any) -> str:
    return repr(v)


def _show(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]" if v else "[] (none)"
    if v is None:
        return "none"
    return str(v)


