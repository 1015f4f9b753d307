"""Where ranks' traces first disagree: the first transition whose plan or guard differs, and whom to suspect.

Ranks are aligned by position (the n-th transition each one started), never
by wall time. The suspects are named by the live guard's own rule
(``miles_fsm.blame``): the ranks that changed the differing field since the
last time this trigger ran with every rank agreeing; else nothing decides
(a tie, or an undecided split), and every rank of the differing groups is
suspect. Used by ``miles_fsm.replay.diagnose``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from miles_fsm.blame import suspects
from miles_fsm.ranks import plural_ranks, rank_ranges
from miles_fsm.replay.attempts import counted_all
from miles_fsm.replay.model import CANCELLED, RankTrace
from miles_fsm.replay.shapes import Difference, FirstDivergence, GuardReport, ValueGroup
from miles_fsm.trace.schema import GUARD_FAILED, error_fields

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


class Divergence(NamedTuple):
    """The first divergence (``Diagnosis.first_divergence``), and its one-line summary (a headline)."""

    found: FirstDivergence
    summary: str


def _global(traces: Sequence[RankTrace]) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    """Per rank, sig and guard ids in one id space shared by all ranks."""
    sig_ids: dict[Any, int] = {}
    guard_ids: dict[Any, int] = {}
    sigs: list[Sequence[int]] = []
    guards: list[Sequence[int]] = []
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
    # A transition cancelled before its guard never ran one: its guard is unknown, not "unguarded" (the
    # reader's fold records it as skipped). Its peers' guard is no disagreement with it.
    for k, t in enumerate(traces):
        cancelled = [i for i, code in enumerate(t.outcome) if code == CANCELLED[0]]
        if cancelled:
            guards[k] = g = list(guards[k])
            for i in cancelled:
                g[i] = -1
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


def first_divergence(traces: Sequence[RankTrace]) -> Divergence | None:
    """The first counted position (``miles_fsm.replay.attempts``) where ranks' intents differ, if any."""
    traces = [t for t in counted_all(traces) if t.positions]
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
    differences: dict[str, tuple[dict[str, list[int]], dict[str, Any]]] = {}
    for n in _FIELDS:
        groups, shown = _groups(at, n)
        if len(groups) > 1:
            differences[n] = (groups, shown)
    if not differences:  # pragma: no cover - ids differ only when some field does
        return None
    name, (groups, shown) = next(iter(differences.items()))
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    found = suspects(groups, previous=_previous(traces, first, name, next(iter(at.values()))["trigger"]))
    lead = at[ordered[0][1][0]]
    not_reached = sorted(r for r, d in at.items() if name in _GUARD_FIELDS and d["guarded"] is None)
    behind = sorted(t.rank for t in traces if t.positions <= first)
    sides = "; ".join(f"{plural_ranks(rs)} {_show(shown[k])}" for k, rs in ordered)
    who = (f"suspect {plural_ranks(list(found.ranks))}: {found.reason}" if found.decided
           else f"{found.reason}: suspect every rank of the differing groups ({rank_ranges(found.ranks)})")  # fmt: skip
    guard = _guard_report(traces, first)
    summary = f"ranks disagree on {name} at {lead['trigger']} (epoch {lead['epoch']}): {sides}; {who}"
    if guard is not None and guard["detail"]:
        summary += f" (the guard: {'; '.join(guard['detail'])})"
    body: FirstDivergence = {
        "position": first,
        "epoch": lead["epoch"],
        "transition": lead["trigger"],
        "field": name,
        "also_differ": list(differences)[1:],
        "groups": [ValueGroup(ranks=rs, value=shown[k]) for k, rs in ordered],
        "differences": [
            Difference(field=n, groups=[ValueGroup(ranks=rs, value=sh[k]) for k, rs in sorted(g.items(), key=_by_size)])
            for n, (g, sh) in differences.items()
        ],
        "guard_report": guard,
        "culprits": list(found.ranks),
        "how": found.how,
        "reason": found.reason,
        "tie": found.tie,
        "decided": found.decided,
        "not_yet_at_guard": not_reached,
        "not_there": behind,
    }
    return Divergence(body, summary)


def _groups(at: dict[int, dict[str, Any]], name: str) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Ranks by their value of one field (a guard field only among ranks whose guard is known)."""
    groups: dict[str, list[int]] = defaultdict(list)
    shown: dict[str, Any] = {}
    for r, d in sorted(at.items()):
        if name in _GUARD_FIELDS and d["guarded"] is None:
            continue
        k = _key(d[name])
        groups[k].append(r)
        shown[k] = d[name]
    return dict(groups), shown


def _by_size(kv: tuple[str, list[int]]) -> tuple[int, int]:
    return -len(kv[1]), kv[1][0]


def _previous(traces: Sequence[RankTrace], first: int, name: str, trigger: str) -> str | None:
    """The field's value the last time, before ``first``, that this trigger ran on every rank.

    Every position before the first divergence is one where the ranks agreed, so any rank that got
    there tells it. None when the trigger itself differs, or it never ran before (with its guard
    recorded, for a guard field): then nothing decides (``miles_fsm.blame``).
    """
    if name == "trigger":
        return None
    t = max(traces, key=lambda x: x.positions)
    for j in range(first - 1, -1, -1):
        if t.trigger_at(j) != trigger:
            continue
        d = t.describe_at(j)
        if name in _GUARD_FIELDS and d["guarded"] is None:
            continue
        return _key(d[name])
    return None


def _guard_report(traces: Sequence[RankTrace], position: int) -> GuardReport | None:
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


