"""Cross-rank diagnosis of folded traces: divergence, stopped ranks, corruption, stragglers.

Ranks are aligned by position (the n-th transition each one started) and
epoch, never by wall time. Wall clocks are used only to say *for how long* a
rank has been silent, and the report says they are an estimate.

Every problem found gets the position it happened at; the verdict is the
earliest one, because what happens after a divergence or a crash (peers time
out, peers fail) is its consequence, not its cause.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_fsm import stalls
from miles_fsm.divergence import first_divergence
from miles_fsm.ranks import plural_ranks, rank_ranges
from miles_fsm import evidence, rank_summary
from miles_fsm.evidence import first_line
from miles_fsm.trace_model import RankTrace

__all__ = ["Diagnosis", "Verdict", "diagnose", "rank_ranges"]


class Verdict:
    """The verdicts of the JSON contract."""

    OK = "ok"
    DIVERGENCE = "divergence"
    STUCK = "stuck"
    CRASHED = "crashed"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"


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

    divergence = first_divergence(traces)
    illegal = sorted((rank_summary.illegal_json(i) for t in traces for i in t.illegal),
                     key=lambda i: (i["position"], i["rank"]))  # fmt: skip
    guard_failures = evidence.guard_failures(traces)
    failures = evidence.step_failures(traces)
    located = stalls.located(traces)
    accused = stalls.accusations(traces, guard_failures, failures, located)
    stuck = stalls.stopped(traces, by_rank, missing, guard_failures, accused, last_wall)
    verification = evidence.verification_failures(traces)

    problems = [
        *_divergence_problems(divergence, illegal, guard_failures),
        *_stop_problems(stuck),
        *([_corruption(verification, located)] if verification else []),
        *_failure_problems(failures, stopped_at=min((s["position"] for s in stuck), default=None)),
    ]
    trace_problems = rank_summary.trace_problems(traces, missing)
    verdict, headline, culprit, notes = _judge(problems, traces, by_rank, missing, trace_problems)
    ranks = [rank_summary.rank_json(t) for t in traces] + [{"rank": r, "status": "missing", "file": None}
                                                           for r in missing]  # fmt: skip
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
        stragglers=stalls.stragglers(traces, straggler_ratio, straggler_floor_s),
        trace_problems=trace_problems,
        notes=notes,
    )


def _divergence_problems(
    divergence: dict[str, Any] | None, illegal: list[dict[str, Any]], guard_failures: list[dict[str, Any]]
) -> list[_Problem]:
    """Ranks that did different things: a divergent intent, an illegal move, or the guard's own report."""
    problems = []
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
                headline=f"{plural_ranks(who)} left the lifecycle definition: {first['reason']} "
                f"(epoch {first['epoch']}, {first['trigger']})",
            )
        )
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
                    f"{g.get('field')}; suspect {plural_ranks(list(culprits)) if culprits else 'unknown'}",
                )
            )
    return problems


def _stop_problems(stuck: list[dict[str, Any]]) -> list[_Problem]:
    """Ranks that stopped: crashed, stuck, or silent with nobody waiting on them (incomplete)."""
    problems = []
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
    return problems


def _failure_problems(failures: list[dict[str, Any]], *, stopped_at: int | None) -> list[_Problem]:
    """Steps that raised (verification failures are judged apart, by ``_corruption``)."""
    problems = []
    for f in failures:
        if f["verification"]:
            continue
        # A peer's crash or hang shows up on the survivors as a failed collective: a consequence.
        consequence = stopped_at is not None and stopped_at <= f["position"] and f["transport"] is not None
        problems.append(
            _Problem(
                verdict=Verdict.CRASHED,
                position=f["position"],
                culprits=(f["rank"],),
                epoch=f["epoch"],
                transition=f["transition"],
                headline=f"rank {f['rank']} failed in {f['action']} of {f['transition']} (epoch {f['epoch']}): "
                f"{f['error']}: {first_line(f['message'])}",
                consequence=consequence,
            )
        )
    return problems


def _judge(
    problems: list[_Problem],
    traces: Sequence[RankTrace],
    by_rank: dict[int, RankTrace],
    missing: list[int],
    trace_problems: dict[str, Any],
) -> tuple[str, str, dict[str, Any] | None, list[str]]:
    """The verdict, headline, culprit and notes: the earliest cause wins; what follows it is its consequence."""
    causes = [p for p in problems if not p.consequence] or problems
    if not causes:
        verdict, headline = _clean_verdict(traces, missing, trace_problems)
        return verdict, headline, None, []
    notes: list[str] = []
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
            f"the traces of {plural_ranks(damaged)} are damaged (records lost to bad lines), and that is where "
            f"they seem to diverge: {headline}"
        )
    later = [p for p in problems if p not in same]
    if later:
        notes.append(f"{len(later)} more problem(s) at or after this point, most likely its consequences (below)")
    return verdict, headline, culprit, notes


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
        why = f"; traced to {plural_ranks(culprits)} by the ranks' own records (data rebuilt from its state)"
    else:
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for v in firsts:
            groups[tuple(v["tensors"])].append(v["rank"])
        if len(groups) > 1:
            ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
            culprits = sorted(r for rs in ordered[1:] for r in rs)
            why = f"; {plural_ranks(culprits)} saw a different set of mismatches than the others"
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
        headline=f"verification failed on {plural_ranks(failed)} in {v0['transition']} (epoch {v0['epoch']}, "
        f"{v0['where']}): {_names(tensors)} changed{why}",
    )


def _clean_verdict(traces: Sequence[RankTrace], missing: list[int], tp: dict[str, Any]) -> tuple[str, str]:
    reasons = []
    if missing:
        reasons.append(f"no trace for {plural_ranks(missing)}")
    if tp["lost_records"]:
        reasons.append(f"{sum(tp['lost_records'].values())} record(s) lost to damaged lines")
    still_open = sorted(t.rank for t in traces if t.open is not None)
    if still_open:
        o = next(t.open for t in traces if t.open is not None)
        reasons.append(
            f"{plural_ranks(still_open)} end inside a transition ({o.trigger}, epoch {o.epoch}) with no rank to blame: "
            "the job was stopped from outside, or is still running"
        )
    lengths = Counter(t.positions for t in traces)
    if len(lengths) > 1:
        most = lengths.most_common(1)[0][0]
        behind = sorted(t.rank for t in traces if t.positions != most)
        reasons.append(f"{plural_ranks(behind)} ended at another point than the others")
    if reasons:
        return Verdict.INCOMPLETE, "the traces are incomplete: " + "; ".join(reasons)
    n = len(traces)
    per = traces[0].positions if traces else 0
    return (
        Verdict.OK,
        f"{n} rank(s), {per} transitions each: no divergence, no stopped rank, no illegal transition, "
        "no verification failure",
    )


# ----------------------------------------------------------------- the rest


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


