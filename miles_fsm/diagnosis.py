"""Cross-rank diagnosis of folded traces: divergence, stopped ranks, corruption, stragglers.

Ranks are aligned by position (the n-th transition each one started) and
epoch, never by wall time. Wall clocks are used only to say *for how long* a
rank has been silent, and the report says they are an estimate.

Every problem found gets the position it happened at; the verdict is the
earliest one, because what happens after a divergence or a crash (peers time
out, peers fail) is its consequence, not its cause.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_fsm.trace_reader import FAILED as OUT_FAILED
from miles_fsm.trace_reader import FINISHED, RankTrace

__all__ = ["Diagnosis", "Verdict", "diagnose", "rank_ranges"]


class Verdict:
    """The verdicts of the JSON contract."""

    OK = "ok"
    DIVERGENCE = "divergence"
    STUCK = "stuck"
    CRASHED = "crashed"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"


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
_CORE_EVENTS = frozenset(
    ("guard_failed", "verify_failed", "store_unreachable", "transition_failed", "transition_cancelled", "recovered")
)
_GUARD_FIELDS = frozenset(("guarded", "collectives", "tensors", "plan fingerprint"))

#: When problems tie on position, the cause comes first.
_RANK = {Verdict.DIVERGENCE: 0, Verdict.CORRUPT: 1, Verdict.CRASHED: 2, Verdict.STUCK: 3, Verdict.INCOMPLETE: 4}


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """Everything replay found; ``to_json()`` is the ``--json`` contract."""

    verdict: str
    headline: str
    world: int
    culprit: dict[str, Any] | None
    ranks: list[dict[str, Any]]
    missing_ranks: list[int]
    first_divergence: dict[str, Any] | None
    stuck: list[dict[str, Any]]
    illegal: list[dict[str, Any]]
    verification: list[dict[str, Any]]
    guard_failures: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    stragglers: list[dict[str, Any]]
    trace_problems: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.verdict == Verdict.OK

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 3

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "headline": self.headline,
            "culprit": self.culprit,
            "world": self.world,
            "ranks": self.ranks,
            "missing_ranks": self.missing_ranks,
            "first_divergence": self.first_divergence,
            "stuck": self.stuck,
            "illegal": self.illegal,
            "verification": self.verification,
            "guard_failures": self.guard_failures,
            "failures": self.failures,
            "stragglers": self.stragglers,
            "trace_problems": self.trace_problems,
            "notes": self.notes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class _Problem:
    verdict: str
    position: int
    culprits: tuple[int, ...]
    epoch: int | None
    transition: str | None
    headline: str
    consequence: bool = False


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-3, 5, 7-9``: a compact list of rank numbers."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def _plural(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


# ------------------------------------------------------------------ diagnose


def diagnose(
    traces: Sequence[RankTrace],
    *,
    expected: Iterable[int] | None = None,
    straggler_ratio: float = 1.5,
    straggler_floor_s: float = 0.01,
) -> Diagnosis:
    """Diagnose folded traces. ``expected``: the ranks asked for (default: the whole world)."""
    by_rank = {t.rank: t for t in traces}
    world = max([t.world for t in traces if t.world] + [max(by_rank, default=-1) + 1])
    wanted = sorted(set(range(world)) if expected is None else set(expected))
    missing = [r for r in wanted if r not in by_rank]
    last_wall = max((t.last_wall for t in traces if t.last_wall is not None), default=None)

    problems: list[_Problem] = []
    divergence = _first_divergence(traces)
    illegal = [_illegal_json(i) for t in traces for i in t.illegal]
    illegal.sort(key=lambda i: (i["position"], i["rank"]))
    if divergence is not None:
        problems.append(
            _Problem(
                verdict=Verdict.DIVERGENCE,
                position=divergence["position"],
                culprits=tuple(divergence["culprits"]),
                epoch=divergence["epoch"],
                transition=divergence["transition"],
                headline=divergence["summary"],
            )
        )
    if illegal:
        first = illegal[0]
        who = sorted({i["rank"] for i in illegal if i["position"] == first["position"]})
        problems.append(
            _Problem(
                verdict=Verdict.DIVERGENCE,
                position=first["position"],
                culprits=tuple(who),
                epoch=first["epoch"],
                transition=first["trigger"],
                headline=f"{_plural(who)} left the lifecycle definition: {first['reason']} "
                f"(epoch {first['epoch']}, {first['trigger']})",
            )
        )

    guard_failures = _guard_failures(traces)
    for g in guard_failures:
        if g["error"] == "RankDivergenceError" and divergence is None:
            culprits = tuple(g.get("culprits") or ())
            problems.append(
                _Problem(
                    verdict=Verdict.DIVERGENCE,
                    position=g["position"],
                    culprits=culprits,
                    epoch=g["epoch"],
                    transition=g["transition"],
                    headline=f"the guard of {g['transition']} (epoch {g['epoch']}) found ranks disagreeing on "
                    f"{g.get('field')}; suspect {_plural(list(culprits)) if culprits else 'unknown'}",
                )
            )

    failures = _step_failures(traces)
    located = _located(traces)
    accused = _accusations(traces, guard_failures, failures, located)
    stuck = _stopped(traces, by_rank, missing, guard_failures, accused, last_wall)
    for s in stuck:
        verdict = {"crashed": Verdict.CRASHED, "stuck": Verdict.STUCK}.get(s["how"])
        if verdict is None:
            verdict = Verdict.STUCK if s["waited_on_by"] or s["located_by"] else Verdict.INCOMPLETE
        problems.append(
            _Problem(
                verdict=verdict,
                position=s["position"],
                culprits=(s["rank"],),
                epoch=s["epoch"],
                transition=s["transition"],
                headline=s["summary"],
            )
        )
    stopped_at = min((s["position"] for s in stuck), default=None)

    verification = _verification(traces)
    if verification:
        problems.append(_corruption(verification, located))

    for f in failures:
        if f["verification"]:
            continue
        # A peer's crash or hang shows up on the survivors as a failed collective: a consequence.
        consequence = stopped_at is not None and stopped_at <= f["position"] and bool(
            _PEER_LOST.search(f["message"] or "") or _TIMED_OUT.search(f["message"] or "")
        )
        problems.append(
            _Problem(
                verdict=Verdict.CRASHED,
                position=f["position"],
                culprits=(f["rank"],),
                epoch=f["epoch"],
                transition=f["transition"],
                headline=f"rank {f['rank']} failed in {f['action']} of {f['transition']} (epoch {f['epoch']}): "
                f"{f['error']}: {_first_line(f['message'])}",
                consequence=consequence,
            )
        )

    trace_problems = _trace_problems(traces, missing)
    notes: list[str] = []
    causes = [p for p in problems if not p.consequence] or problems
    if causes:
        first_pos = min(p.position for p in causes)
        at_first = sorted((p for p in causes if p.position == first_pos), key=lambda p: _RANK[p.verdict])
        lead = at_first[0]
        same = [p for p in at_first if p.verdict == lead.verdict]
        culprits = sorted({r for p in same for r in p.culprits})
        verdict = lead.verdict
        headline = lead.headline if len(same) == 1 else f"{lead.headline} (and {len(same) - 1} more like it)"
        culprit = {"ranks": culprits, "epoch": lead.epoch, "transition": lead.transition, "position": first_pos}
        damaged = [r for r in culprits if r in by_rank and (by_rank[r].lost or by_rank[r].bad)]
        if verdict == Verdict.DIVERGENCE and culprits and len(damaged) == len(culprits):
            # A lost record shifts that rank's transitions: the "divergence" may be the damage itself.
            verdict = Verdict.INCOMPLETE
            headline = (
                f"the traces of {_plural(damaged)} are damaged (records lost to bad lines), and that is where "
                f"they seem to diverge: {headline}"
            )
        later = [p for p in problems if p not in same]
        if later:
            notes.append(f"{len(later)} more problem(s) at or after this point, most likely its consequences (below)")
    else:
        culprit = None
        verdict, headline = _clean_verdict(traces, missing, trace_problems)
    stragglers = _stragglers(traces, straggler_ratio, straggler_floor_s)
    ranks = [_rank_json(t) for t in traces] + [{"rank": r, "status": "missing", "file": None} for r in missing]
    ranks.sort(key=lambda r: r["rank"])
    return Diagnosis(
        verdict=verdict,
        headline=headline,
        world=world,
        culprit=culprit,
        ranks=ranks,
        missing_ranks=missing,
        first_divergence=None if divergence is None else {k: v for k, v in divergence.items() if k != "summary"},
        stuck=stuck,
        illegal=illegal,
        verification=verification,
        guard_failures=guard_failures,
        failures=failures,
        stragglers=stragglers,
        trace_problems=trace_problems,
        notes=notes,
    )


def _corruption(verification: list[dict[str, Any]], located: list[dict[str, Any]]) -> _Problem:
    """The first verification failure, traced to the rank whose data was wrong where the records allow."""
    first_pos = min(v["position"] for v in verification)
    firsts = [v for v in verification if v["position"] == first_pos]
    failed = sorted({v["rank"] for v in firsts})
    tensors = sorted({n for v in firsts for n in v["tensors"]})
    v0 = firsts[0]
    named = Counter(c for loc in located if loc["position"] >= first_pos - 1 for c in loc["culprits"])
    if named:
        top = max(named.values())
        culprits = sorted(r for r, n in named.items() if n == top)
        why = f"; traced to {_plural(culprits)} by the ranks' own records (data rebuilt from its state)"
    else:
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for v in firsts:
            groups[tuple(v["tensors"])].append(v["rank"])
        if len(groups) > 1:
            ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
            culprits = sorted(r for rs in ordered[1:] for r in rs)
            why = f"; {_plural(culprits)} saw a different set of mismatches than the others"
        else:
            culprits = failed
            why = ""
            if len(failed) > 1:
                why = "; every rank saw the same mismatch, so the traces do not say whose data was wrong"
    return _Problem(
        verdict=Verdict.CORRUPT,
        position=first_pos,
        culprits=tuple(culprits),
        epoch=v0["epoch"],
        transition=v0["transition"],
        headline=f"verification failed on {_plural(failed)} in {v0['transition']} (epoch {v0['epoch']}, "
        f"{v0['where']}): {_names(tensors)} changed{why}",
    )


def _clean_verdict(traces: Sequence[RankTrace], missing: list[int], tp: dict[str, Any]) -> tuple[str, str]:
    reasons = []
    if missing:
        reasons.append(f"no trace for {_plural(missing)}")
    if tp["lost_records"]:
        reasons.append(f"{sum(tp['lost_records'].values())} record(s) lost to damaged lines")
    still_open = sorted(t.rank for t in traces if t.open is not None)
    if still_open:
        o = next(t.open for t in traces if t.open is not None)
        reasons.append(
            f"{_plural(still_open)} end inside a transition ({o.trigger}, epoch {o.epoch}) with no rank to blame: "
            "the job was stopped from outside, or is still running"
        )
    lengths = Counter(t.positions for t in traces)
    if len(lengths) > 1:
        most = lengths.most_common(1)[0][0]
        behind = sorted(t.rank for t in traces if t.positions != most)
        reasons.append(f"{_plural(behind)} ended at another point than the others")
    if reasons:
        return Verdict.INCOMPLETE, "the traces are incomplete: " + "; ".join(reasons)
    n = len(traces)
    per = traces[0].positions if traces else 0
    return (
        Verdict.OK,
        f"{n} rank(s), {per} transitions each: no divergence, no stopped rank, no illegal transition, "
        "no verification failure",
    )


# ---------------------------------------------------------------- divergence


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


def _first_divergence(traces: Sequence[RankTrace]) -> dict[str, Any] | None:
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
    others = ", ".join(f"{_plural(rs)} {_show(shown[k])}" for k, rs in ordered[1:])
    also = [
        n
        for n in _FIELDS[_FIELDS.index(name) + 1 :]
        if len({_key(d[n]) for d in at.values() if not (n in _GUARD_FIELDS and d["guarded"] is None)}) > 1
    ]
    guard = _guard_report(traces, first)
    summary = (
        f"ranks disagree on {name} at {maj['trigger']} (epoch {maj['epoch']}): "
        f"{_plural(majority)} {_show(shown[ordered[0][0]])}; {others}"
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
            if n.position == position and n.event == "guard_failed" and n.record.get("error") == "RankDivergenceError":
                rec = n.record
                lines = (rec.get("message") or "").splitlines()[1:]
                detail = [x.strip() for x in lines if x.startswith("  ") and not x.strip().startswith("ranks [")
                          or "lack" in x]
                return {"field": rec.get("field"), "groups": rec.get("groups"), "culprits": rec.get("culprits"),
                        "detail": detail, "rank": t.rank}
    return None


def _key(v: Any) -> str:
    return repr(v)


def _show(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]" if v else "[] (none)"
    if v is None:
        return "none"
    return str(v)


# ----------------------------------------------------------------- failures


def _guard_failures(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Guard failures grouped by position and error: who failed and what they said."""
    grouped: dict[tuple[int, str], dict[str, Any]] = {}
    for t in traces:
        for n in t.notes:
            if n.event != "guard_failed":
                continue
            rec = n.record
            key = (n.position, rec.get("error") or "?")
            g = grouped.get(key)
            if g is None:
                g = grouped[key] = {
                    "position": n.position,
                    "epoch": rec.get("epoch"),
                    "transition": rec.get("trigger"),
                    "error": rec.get("error"),
                    "ranks": [],
                    "missing": set(),
                    "field": rec.get("field"),
                    "culprits": rec.get("culprits"),
                    "groups": rec.get("groups"),
                    "message": _first_line(rec.get("message") or ""),
                }
            g["ranks"].append(t.rank)
            g["missing"].update(rec.get("missing") or ())
    out = []
    for g in sorted(grouped.values(), key=lambda g: (g["position"], str(g["error"]))):
        g["ranks"].sort()
        g["missing"] = sorted(g["missing"])
        out.append(g)
    return out


def _verification(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    out = []
    for t in traces:
        for n in t.notes:
            if n.event == "verify_failed":
                rec = n.record
                out.append(
                    {
                        "rank": t.rank,
                        "position": n.position,
                        "epoch": rec.get("epoch"),
                        "transition": rec.get("trigger"),
                        "where": rec.get("where") or "trainer",
                        "tensors": list(rec.get("tensors") or ()),
                        "line": n.line,
                    }
                )
    out.sort(key=lambda v: (v["position"], v["rank"]))
    return out


_VERIFY_ERRORS = frozenset(("VerificationError", "TensorSetChangedError"))


def _step_failures(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Transitions that failed in a step (an action raised): not the guard's failures."""
    out = []
    for t in traces:
        for n in t.notes:
            rec = n.record
            if n.event != "transition_failed" or rec.get("phase") != "step":
                continue
            out.append(
                {
                    "rank": t.rank,
                    "position": n.position,
                    "epoch": rec.get("epoch"),
                    "transition": rec.get("trigger"),
                    "action": rec.get("action"),
                    "error": rec.get("error"),
                    "message": rec.get("message"),
                    "verification": rec.get("error") in _VERIFY_ERRORS,
                }
            )
    out.sort(key=lambda f: (f["position"], f["rank"]))
    return out


# ------------------------------------------------------------ stopped ranks


_PEER_LOST = re.compile(
    r"connection (?:closed|reset) by peer|remote worker crash|peer (?:lost|closed)|broken pipe", re.I
)
_TIMED_OUT = re.compile(r"timed? ?out|timeout", re.I)


def _located(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Faults that a driver or the demo located itself: records of their own with a ``culprits`` list."""
    out = []
    for t in traces:
        for n in t.notes:
            culprits = n.record.get("culprits")
            if n.event in _CORE_EVENTS or not isinstance(culprits, list) or not culprits:
                continue
            out.append(
                {
                    "rank": t.rank,
                    "event": n.event,
                    "position": n.position,
                    "epoch": n.record.get("epoch"),
                    "culprits": sorted(int(c) for c in culprits if isinstance(c, int)),
                    "error": n.record.get("error"),
                    "where": n.record.get("where"),
                }
            )
    return out


def _accusations(
    traces: Sequence[RankTrace],
    guard_failures: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    located: list[dict[str, Any]],
) -> dict[int, list[dict[str, Any]]]:
    """Who the surviving ranks' records blame for stopping, and how (lost connection, timeout, located)."""
    accused: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for g in guard_failures:
        kind = {"GuardTimeoutError": "timeout", "PeerLostError": "lost"}.get(g["error"])
        if kind is None:
            continue
        via = f"the guard of {g['transition']} (epoch {g['epoch']}, {g['error']})"
        for m in g["missing"]:
            accused[m].append({"kind": kind, "by": g["ranks"], "position": g["position"], "epoch": g["epoch"],
                               "transition": g["transition"], "via": via})
    # A collective that failed on some ranks and left another silent mid-transition: the silent one.
    silent = {t.rank: t.open.index for t in traces if t.open is not None}
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for f in failures:
        message = f["message"] or ""
        kind = "lost" if _PEER_LOST.search(message) else ("timeout" if _TIMED_OUT.search(message) else None)
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
    for loc in located:
        for c in loc["culprits"]:
            if c != loc["rank"]:
                accused[c].append({"kind": "located", "by": [loc["rank"]], "position": loc["position"],
                                   "epoch": loc["epoch"], "transition": loc["where"],
                                   "via": f"its own {loc['event']} record"})
    return accused


def _stopped(
    traces: Sequence[RankTrace],
    by_rank: dict[int, RankTrace],
    missing: list[int],
    guard_failures: list[dict[str, Any]],
    accused: dict[int, list[dict[str, Any]]],
    last_wall: float | None,
) -> list[dict[str, Any]]:
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
    # Only accusations that could explain a stop: located faults alone name culprits of other kinds too.
    candidates = {r for r, acc in accused.items() if any(a["kind"] != "located" for a in acc)}
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
    return [
        _stopped_entry(
            r, by_rank.get(r), accused.get(r, []), sorted(w for w in waiting if w != r), traces, last_wall,
            unread=r not in by_rank and r not in missing,
        )
        for r in sorted(candidates)
    ]


def _stopped_entry(
    r: int,
    t: RankTrace | None,
    acc: list[dict[str, Any]],
    waiters: list[int],
    traces: Sequence[RankTrace],
    last_wall: float | None,
    *,
    unread: bool = False,
) -> dict[str, Any]:
    decisive = [a for a in acc if a["kind"] != "located"]
    at = min(decisive or acc, key=lambda a: a["position"]) if acc else None
    since = None if t is None else t.last_wall
    if t is None:
        state, epoch, position, transition = None, at["epoch"] if at else None, None, None
        inside = "its trace was not read (left out by --rank)" if unread else "no trace at all"
    elif t.open is not None:
        o = t.open
        state, epoch, position, transition = o.source, o.epoch, o.index, o.trigger
        inside = {
            "planning": f"{o.trigger}, before its guard",
            "guard": f"the guard of {o.trigger}",
            "step": f"action {o.action} of {o.trigger}",
            "between steps": f"{o.trigger}, after its action {o.action}",
        }[o.phase]
    else:
        state, epoch, position = t.state, t.epoch, t.positions
        done = t.trigger_at(t.positions - 1) if t.positions else "nothing"
        transition = at["transition"] if at else _next_trigger(traces, t.positions)
        if at is not None and at["epoch"] is not None:
            epoch = at["epoch"]
        inside = f"between transitions: it finished {done}" + (f" and never started {transition}" if transition else "")
    if position is None:
        position = at["position"] if at else min((x.positions for x in traces), default=0)
    silent = None if since is None or last_wall is None else max(0.0, last_wall - since)
    how, evidence = _how(r, t, acc)
    verb = {"crashed": "crashed", "stuck": "is stuck", "unknown": "stopped"}[how]
    if t is None:
        summary = f"rank {r} {verb}: " + ("its trace was not read (--rank)" if unread else "it left no trace")
    elif t.open is not None:
        summary = f"rank {r} {verb} in {inside} (epoch {epoch}, state {state})"
    else:
        summary = f"rank {r} {verb} in {state}, {inside} (epoch {epoch})"
    if silent is not None and silent >= 0.1:
        summary += f"; silent for ~{silent:.1f} s before the last record of any rank"
    accusers = sorted({x for a in decisive for x in a["by"]})
    if accusers:
        summary += f"; {_plural(accusers)} " + (
            "lost their connection to it" if how == "crashed" else "timed out waiting for it"
        )
    elif waiters:
        summary += f"; {_plural(waiters)} were waiting for it at a guard"
    return {
        "rank": r,
        "state": state,
        "epoch": epoch,
        "transition": transition,
        "position": position,
        "inside": inside,
        "silent_s": silent,
        "silent_basis": "wall clocks of different ranks (an estimate)",
        "how": how,
        "evidence": evidence,
        "accused_by": accusers,
        "located_by": sorted({x for a in acc if a["kind"] == "located" for x in a["by"]}),
        "waited_on_by": waiters,
        "summary": summary,
    }


def _how(r: int, t: RankTrace | None, acc: list[dict[str, Any]]) -> tuple[str, str]:
    kinds = Counter(a["kind"] for a in acc)
    lost = [a for a in acc if a["kind"] == "lost"]
    timeout = [a for a in acc if a["kind"] == "timeout"]
    located = sorted({x for a in acc if a["kind"] == "located" for x in a["by"]})
    also = f"; {_plural(located)} also named it as the culprit" if located else ""
    if lost and kinds["lost"] >= kinds["timeout"]:
        a = lost[0]
        return "crashed", (
            f"{_plural(sorted({x for a in lost for x in a['by']}))} lost their connection to rank {r} in "
            f"{a['via']} and recorded it, while rank {r} recorded nothing more: its process was gone{also}"
        )
    if timeout:
        a = timeout[0]
        return "stuck", (
            f"{_plural(sorted({x for a in timeout for x in a['by']}))} waited the full timeout for rank {r} in "
            f"{a['via']}: its process was alive (its connections stayed open) but it never arrived{also}"
        )
    if t is not None and t.truncated is not None:
        return "crashed", f"its last line ({t.truncated.where}) is cut short: the process died while writing it{also}"
    if t is None:
        return "unknown", f"its trace is not here; whether it crashed, hung or never started is not in the records{also}"
    return "unknown", (
        "no surviving rank recorded a timeout or a lost connection naming it, so the traces cannot tell "
        f"whether it crashed or hung; check its exit status, or py-spy dump it if it is still alive{also}"
    )


def _next_trigger(traces: Sequence[RankTrace], index: int) -> str | None:
    for t in traces:
        if t.positions > index:
            return t.trigger_at(index)
    return None


# -------------------------------------------------------------- stragglers


def _stragglers(traces: Sequence[RankTrace], ratio: float, floor_s: float) -> list[dict[str, Any]]:
    """Per trigger: the rank with the most own work time (guard wait excluded) against the median."""
    import numpy as np

    traces = [t for t in traces if t.positions]
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
    out = []
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
        entry: dict[str, Any] = {
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


# ----------------------------------------------------------------- the rest


def _trace_problems(traces: Sequence[RankTrace], missing: list[int]) -> dict[str, Any]:
    bad = [
        {"file": b.path, "line": b.line, "where": b.where, "reason": b.reason, "text": b.text}
        for t in traces
        for b in t.bad
    ]
    truncated = [
        {"file": t.truncated.path, "line": t.truncated.line, "where": t.truncated.where, "rank": t.rank}
        for t in traces
        if t.truncated is not None
    ]
    lost = {str(t.rank): t.lost for t in traces if t.lost}
    warnings = []
    for t in traces:
        if t.opened > 1:
            warnings.append(f"{t.path} holds {t.opened} runs (trace_opened {t.opened} times); positions may mix them")
        if t.out_of_order:
            warnings.append(f"{t.path}: {t.out_of_order} record(s) out of sequence order")
        if "rank_in_records" in t.meta:
            warnings.append(f"{t.path} holds records of rank {t.meta['rank_in_records']}")
        v = t.meta.get("v")
        if v is not None and v != 1:
            warnings.append(f"{t.path}: schema version {v}; replay reads version 1")
    return {
        "bad_lines": bad,
        "truncated": truncated,
        "lost_records": lost,
        "missing_ranks": missing,
        "warnings": warnings,
    }


def _illegal_json(i: Any) -> dict[str, Any]:
    return {
        "rank": i.rank,
        "position": i.position,
        "line": i.line,
        "seq": i.seq,
        "epoch": i.epoch,
        "trigger": i.trigger,
        "state": i.state,
        "reason": i.reason,
    }


def _rank_json(t: RankTrace) -> dict[str, Any]:
    if t.open is not None:
        status = "open"
    elif t.state == "FAILED":
        status = "failed"
    elif t.positions == 0:
        status = "empty"
    else:
        status = "done"
    out: dict[str, Any] = {
        "rank": t.rank,
        "file": t.path,
        "status": status,
        "state": t.state,
        "epoch": t.epoch,
        "transitions": t.positions,
        "finished": sum(1 for c in t.outcome if c == FINISHED[0]),
        "failed": sum(1 for c in t.outcome if c == OUT_FAILED[0]),
        "last_event": t.last_event,
        "last_seq": t.last_seq,
        "records": t.records,
        "verified": t.verified,
        "host": t.meta.get("host"),
        "pid": t.meta.get("pid"),
        "strategy": t.strategy,
    }
    if t.open is not None:
        out["inside"] = {
            "transition": t.open.trigger,
            "epoch": t.open.epoch,
            "phase": t.open.phase,
            "action": t.open.action,
        }
    fail = next((n.record for n in reversed(t.notes) if n.event == "transition_failed"), None)
    if fail is not None and t.state == "FAILED":
        out["error"] = {
            "type": fail.get("error"),
            "message": _first_line(fail.get("message") or ""),
            "transition": fail.get("trigger"),
            "epoch": fail.get("epoch"),
            "action": fail.get("action"),
        }
    return out


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


