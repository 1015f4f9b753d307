"""Cross-rank diagnosis of folded traces: divergence, stopped ranks, corruption, stragglers.

Ranks are aligned by position (the n-th transition each one started) and
epoch, never by wall time. Wall clocks are used only to say *for how long* a
rank has been silent, and the report says they are an estimate.

Every problem found gets the position it happened at; the verdict is the
earliest one, because what happens after a divergence or a crash (peers time
out, peers fail) is its consequence, not its cause.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_fsm.ranks import plural_ranks, rank_ranges
from miles_fsm.replay import evidence, stalls
from miles_fsm.replay import summary as rank_summary
from miles_fsm.replay.attempts import counted
from miles_fsm.replay.model import Damage, RankTrace
from miles_fsm.replay.problems import (
    RANK,
    Problem,
    Verdict,
    corruption,
    damage_problems,
    divergence_problems,
    failure_problems,
    outside_problems,
    outside_stop_problems,
    stop_problems,
    undamaged_divergence,
)
from miles_fsm.replay.shapes import (
    Culprit,
    DamageEntry,
    FirstDivergence,
    FlightRecorderReport,
    GuardFailure,
    IllegalMove,
    Leak,
    OutsideFailure,
    RankEntry,
    StepFailure,
    StoppedRank,
    Straggler,
    TraceProblems,
    VerificationFailure,
)
from miles_fsm.replay.verifications import with_verification_damage

__all__ = ["Diagnosis", "Verdict", "diagnose", "rank_ranges"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """Everything replay found; ``to_json()`` is the ``--json`` contract."""

    verdict: Verdict
    headline: str
    world: int
    culprit: Culprit | None
    ranks: list[RankEntry]
    missing_ranks: list[int]
    first_divergence: FirstDivergence | None
    stuck: list[StoppedRank]
    illegal: list[IllegalMove]
    verification: list[VerificationFailure]
    guard_failures: list[GuardFailure]
    failures: list[StepFailure]
    outside_failures: list[OutsideFailure]
    stragglers: list[Straggler]
    trace_problems: TraceProblems
    notes: list[str] = field(default_factory=list)
    #: What the Flight Recorder dumps say (``FrReport.to_json()``); None: no dumps were read.
    flight_recorder: FlightRecorderReport | None = None
    #: Memory kept alive cycle after cycle (``miles_fsm.replay.leaks``): beside the verdict, never one.
    leaks: list[Leak] = field(default_factory=list)
    @property
    def word(self) -> str:
        """The report's first word: the verdict, except ``FAILED`` for a ``crashed`` verdict whose culprit raised
        (its process was alive to record the error) rather than died, and ``STOPPED`` for one stopped by a signal sent
        to it alone. ``--json`` keeps the verdict."""
        if self.verdict != Verdict.CRASHED or self.culprit is None:
            return self.verdict.upper()
        c = self.culprit
        if any(f["error"] == evidence.SIGNALLED and f["rank"] in c["suspects"] for f in self.outside_failures):
            return "STOPPED"
        died = any(s["how"] == "crashed" and s["rank"] in c["suspects"] and s["position"] == c["position"]
                   for s in self.stuck)  # fmt: skip
        return "CRASHED" if died else "FAILED"

    @property
    def healthy(self) -> bool:
        fr = self.flight_recorder
        return self.verdict == Verdict.OK and not (fr is not None and fr.get("mismatch")) and not self.leaks

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
            "outside_failures": self.outside_failures,
            "stragglers": self.stragglers,
            "trace_problems": self.trace_problems,
            "notes": self.notes,
            "flight_recorder": self.flight_recorder,
            "leaks": self.leaks,
        }


# ------------------------------------------------------------------ diagnose


def diagnose(
    traces: Sequence[RankTrace],
    *,
    expected: Iterable[int] | None = None,
    straggler_ratio: float = 1.5,
    straggler_floor_s: float = 0.01,
    run: str | None = None,
    ignored: Sequence[str] = (),
    warnings: Sequence[str] = (),
    misnamed: Sequence[Damage] = (),
) -> Diagnosis:
    """Diagnose folded traces (of one run). ``expected``: the ranks asked for (default: the whole world).

    ``ignored`` and ``warnings``: rank files left out as other runs', and what choosing the run found;
    ``misnamed``: the directory's names that look like rank files' but are not (damage, besides each file's).
    """
    traces = with_verification_damage(traces)  # what only the ranks together show: damage, as a file's own
    by_rank = {t.rank: t for t in traces}
    world = rank_summary.world_of(traces)
    wanted = sorted(set(range(world)) if expected is None else set(expected))
    missing = [r for r in wanted if r not in by_rank]
    last_wall = max((t.last_wall for t in traces if t.last_wall is not None), default=None)

    # A rank that lost records has its positions shifted: what only it disagrees on may be the damage.
    damaged = {t.rank for t in traces if t.lost}
    divergence, damage = undamaged_divergence(traces, damaged)
    illegal = sorted((rank_summary.illegal_json(i) for t in traces for i in t.illegal),
                     key=lambda i: (i["position"], i["rank"]))  # fmt: skip
    guard_failures = evidence.guard_failures(traces)
    failures = evidence.step_failures(traces)
    outside = evidence.outside_failures(traces)
    located = stalls.located(traces)
    accused = stalls.accusations(traces, guard_failures, failures, located, outside)
    stuck = stalls.stopped(traces, by_rank, missing, guard_failures, accused, last_wall)
    verification = evidence.verification_failures(traces)

    problems = [
        # First: at the same position, the stop from outside explains the ranks it found mid-way.
        *outside_stop_problems(evidence.outside_stops(traces)),
        *divergence_problems(divergence, [i for i in illegal if i["rank"] not in damaged], guard_failures),
        *damage_problems(damage, [i for i in illegal if i["rank"] in damaged], by_rank),
        *stop_problems(stuck),
        *([corruption(verification, located)] if verification else []),
        *failure_problems(failures, stopped_at=min((s["position"] for s in stuck), default=None)),
        *outside_problems(outside, stopped=bool(stuck)),
    ]
    trace_problems = rank_summary.trace_problems(traces, missing, run=run, ignored=ignored, warnings=warnings,
                                                 world=world, damaged=misnamed)  # fmt: skip
    verdict, headline, culprit, notes = _judge(problems, traces, missing, trace_problems)
    ranks: list[RankEntry] = [rank_summary.rank_json(t) for t in traces]
    ranks += [{"rank": r, "status": "missing", "file": None} for r in missing]
    ranks.sort(key=lambda r: r["rank"])
    return Diagnosis(
        verdict=verdict,
        headline=headline,
        world=world,
        culprit=culprit,
        ranks=ranks,
        missing_ranks=missing,
        first_divergence=None if divergence is None else divergence.found,
        stuck=stuck,
        illegal=illegal,
        verification=verification,
        guard_failures=guard_failures,
        failures=failures,
        outside_failures=outside,
        stragglers=stalls.stragglers(traces, straggler_ratio, straggler_floor_s),
        trace_problems=trace_problems,
        notes=notes,
    )


def _judge(
    problems: list[Problem],
    traces: Sequence[RankTrace],
    missing: list[int],
    trace_problems: TraceProblems,
) -> tuple[Verdict, str, Culprit | None, list[str]]:
    """The verdict, headline, culprit and notes: the earliest cause wins; what follows it is its consequence."""
    causes = [p for p in problems if not p.consequence] or problems
    if not causes:
        verdict, headline = _clean_verdict(traces, missing, trace_problems)
        return verdict, headline, None, []
    notes: list[str] = []
    first_pos = min(p.position for p in causes)
    at_first = sorted((p for p in causes if p.position == first_pos), key=lambda p: RANK[p.verdict])
    lead = at_first[0]
    same = [p for p in at_first if p.verdict == lead.verdict]
    # Only what the evidence singles out is a culprit (an illegal move singles out its rank where the
    # divergence it makes is undecided); suspects it cannot tell apart are named as such, never as culprits.
    singled = sorted({r for p in same if p.decided for r in p.culprits})
    suspects = singled or sorted({r for p in same for r in p.culprits})
    decided = bool(singled)
    verdict = lead.verdict
    headline = lead.headline if len(same) == 1 else f"{lead.headline} (and {len(same) - 1} more like it)"
    culprit: Culprit = {"ranks": suspects if decided else [], "decided": decided, "suspects": suspects, "epoch": lead.epoch,
               "transition": lead.transition, "position": first_pos}  # fmt: skip
    later = [p for p in problems if p not in same]
    if later:
        notes.append(f"{len(later)} more problem(s) at or after this point, most likely its consequences (below)")
    if trace_problems["damaged"]:
        notes.append(f"the traces are damaged ({_damage(trace_problems['damaged'])}): what they show may be the damage")
    return verdict, headline, culprit, notes


def _clean_verdict(traces: Sequence[RankTrace], missing: list[int], tp: TraceProblems) -> tuple[Verdict, str]:
    """OK only if every rank's trace ends in a clean ``trace_closed`` and nothing in the files is damaged."""
    reasons = []
    if tp["damaged"]:
        reasons.append(f"damaged: {_damage(tp['damaged'])}")
    if missing:
        reasons.append(f"no trace for {plural_ranks(missing)}")
    if tp["lost_records"]:
        reasons.append(f"{sum(tp['lost_records'].values())} record(s) lost to damaged lines")
    if tp["bad_lines"] or tp["truncated"]:
        reasons.append(f"{len(tp['bad_lines']) + len(tp['truncated'])} line(s) that are not trace records")
    still_open = sorted(t.rank for t in traces if t.open is not None)
    if still_open:
        o = next(t.open for t in traces if t.open is not None)
        reasons.append(
            f"{plural_ranks(still_open, ('ends', 'end'))} inside a transition ({o.trigger}, epoch {o.epoch}) with no rank to blame: "
            "the job was stopped from outside, or is still running"
        )
    cut = [t for t in traces if t.closed is None and t.open is None]
    if cut:
        ends = "; ".join(_end(t) for t in cut[:4])
        more = f" and {len(cut) - 4} more" if len(cut) > 4 else ""
        why = "schema v1 traces have no trace_closed" if all(t.meta.get("schema") == 1 for t in cut) else \
            "cut off: killed, hung or still running"  # fmt: skip
        reasons.append(f"{plural_ranks([t.rank for t in cut], ('ends', 'end'))} without trace_closed ({why}): {ends}{more}")
    after = sorted(t.rank for t in traces if t.after_close)
    if after:
        reasons.append(f"{plural_ranks(after)} wrote records after trace_closed")
    unclean = sorted(t.rank for t in traces if t.closed is not None and t.closed.get("clean") is not True)
    if unclean:
        reasons.append(f"{plural_ranks(unclean, ('closed its', 'closed their'))} trace on an error")
    # Alignment's count: a transition cancelled before its guard, then fired again, is no extra step.
    counts = {t.rank: counted(t).positions for t in traces}
    lengths = Counter(counts.values())
    if len(lengths) > 1:
        most = lengths.most_common(1)[0][0]
        behind = sorted(r for r, n in counts.items() if n != most)
        reasons.append(f"{plural_ranks(behind)} ended at another point than the others")
    if reasons:
        return Verdict.INCOMPLETE, "the traces are incomplete: " + "; ".join(reasons)
    n = len(traces)
    per = counts[traces[0].rank] if traces else 0
    return (
        Verdict.OK,
        f"{n} rank(s), {per} transitions each: no divergence, no stopped rank, no illegal transition, "
        "no verification failure",
    )


def _end(t: RankTrace) -> str:
    """Where a cut-off trace ends: its last record (a file with none readable yet says so)."""
    if t.last_event is None:
        return f"rank {t.rank} with no readable record yet"
    return (f"rank {t.rank} after {t.last_event}" + (f" of {t.last_subject}" if t.last_subject else "")
            + f" (epoch {t.epoch}" + ("" if t.last_seq is None else f", seq {t.last_seq}") + ")")


def _damage(damaged: list[DamageEntry]) -> str:
    """The first few damaged files, each with its first damage (all of it is under ``trace_problems.damaged``)."""
    first: dict[str, str] = {}
    for d in damaged:
        first.setdefault(d["file"], d["reason"])
    shown = "; ".join(f"{os.path.basename(f)}: {r}" for f, r in list(first.items())[:3])
    return shown + (f"; and {len(first) - 3} more file(s)" if len(first) > 3 else "")
