"""The problems each kind of evidence gives, each at the position (the n-th transition) it happened.

``miles_fsm.replay.diagnose`` gathers the evidence and judges: the earliest cause
is the verdict, and what follows from it (a peer's failed collective after
a crash) is its consequence.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from miles_fsm.ranks import plural_ranks
from miles_fsm.replay.divergence import Divergence, first_divergence
from miles_fsm.replay.evidence import SIGNALLED, first_line
from miles_fsm.replay.model import RankTrace
from miles_fsm.replay.shapes import (
    GuardFailure,
    IllegalMove,
    LocatedFault,
    OutsideFailure,
    OutsideStop,
    StepFailure,
    StoppedRank,
    VerificationFailure,
)
from miles_fsm.trace.schema import TRACE_CLOSED

__all__ = [
    "RANK",
    "Problem",
    "Verdict",
    "corruption",
    "damage_problems",
    "divergence_problems",
    "failure_problems",
    "outside_problems",
    "outside_stop_problems",
    "stop_problems",
    "undamaged_divergence",
]


class Verdict(str, Enum):
    """The verdicts of the JSON contract: each member is its JSON string (``Verdict.OK == "ok"``).

    ``str`` and ``Enum`` rather than ``StrEnum`` (Python 3.11+): 3.10 is supported. ``__str__`` and
    ``__format__`` give the value, as ``StrEnum``'s do, so f-strings and reports print ``ok``.
    """

    OK = "ok"
    DIVERGENCE = "divergence"
    STUCK = "stuck"
    CRASHED = "crashed"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: When problems tie on position, the cause comes first.
RANK = {Verdict.DIVERGENCE: 0, Verdict.CORRUPT: 1, Verdict.CRASHED: 2, Verdict.STUCK: 3, Verdict.INCOMPLETE: 4}


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    verdict: Verdict
    position: int
    culprits: tuple[int, ...]
    epoch: int | None
    transition: str | None
    headline: str
    consequence: bool = False
    #: False when the evidence does not single the culprits out (a tie, an undecided split): they are
    #: suspects only, and the verdict's ``culprit`` names nobody.
    decided: bool = True


def divergence_problems(
    divergence: Divergence | None, illegal: list[IllegalMove], guard_failures: list[GuardFailure]
) -> list[Problem]:
    """Ranks that did different things: a divergent intent, an illegal move, or the guard's own report."""
    problems = []
    if divergence is not None:
        found = divergence.found
        problems.append(
            Problem(
                verdict=Verdict.DIVERGENCE,
                position=found["position"],
                culprits=tuple(found["culprits"]),
                epoch=found["epoch"],
                transition=found["transition"],
                headline=divergence.summary,
                decided=found["decided"],
            )
        )
    if illegal:
        first = illegal[0]
        who = sorted({i["rank"] for i in illegal if i["position"] == first["position"]})
        problems.append(
            Problem(
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
            culprits = tuple(g["culprits"] or ())
            decided = bool(culprits) and g.get("how") == "changed"
            problems.append(
                Problem(
                    verdict=Verdict.DIVERGENCE,
                    position=g["position"],
                    culprits=culprits,
                    epoch=g["epoch"],
                    transition=g["transition"],
                    headline=f"the guard of {g['transition']} (epoch {g['epoch']}) found ranks disagreeing on "
                    f"{g.get('field')}; suspect {plural_ranks(list(culprits)) if culprits else 'unknown'}"
                    + ("" if decided else " (the guard's evidence does not decide between them)"),
                    decided=decided,
                )
            )
    return problems


def undamaged_divergence(
    traces: Sequence[RankTrace], damaged: set[int]
) -> tuple[Divergence | None, Divergence | None]:
    """The first divergence the undamaged ranks bear out, and one that only damaged ranks show (or None)."""
    divergence = first_divergence(traces)
    if divergence is None or not damaged & {r for g in divergence.found["groups"] for r in g["ranks"]}:
        return divergence, None
    return first_divergence([t for t in traces if t.rank not in damaged]), divergence


def damage_problems(
    damage: Divergence | None, illegal: list[IllegalMove], by_rank: dict[int, RankTrace]
) -> list[Problem]:
    """What looks like a divergence or an illegal move only on ranks that lost records: their damage."""
    seen: list[tuple[int, int | None, str | None, str, list[int]]] = []
    if damage is not None:
        d = damage.found
        seen.append((d["position"], d["epoch"], d["transition"], damage.summary,
                     sorted(r for g in d["groups"] for r in g["ranks"] if by_rank[r].lost)))  # fmt: skip
    if illegal:
        first = illegal[0]
        seen.append((first["position"], first["epoch"], first["trigger"], first["reason"],
                     sorted({i["rank"] for i in illegal if i["position"] == first["position"]})))  # fmt: skip
    problems = []
    for position, epoch, transition, what, ranks in seen:
        lost = sum(by_rank[r].lost for r in ranks)
        problems.append(
            Problem(
                verdict=Verdict.INCOMPLETE,
                position=position,
                culprits=tuple(ranks),
                epoch=epoch,
                transition=transition,
                headline=f"the traces of {plural_ranks(ranks)} are damaged ({lost} record(s) lost), and that is "
                f"where they seem to diverge: {what}",
            )
        )
    return problems


def outside_problems(outside: list[OutsideFailure], *, stopped: bool) -> list[Problem]:
    """Failures outside any transition, the first per rank; a rank already FAILED carries on its own failure."""
    problems = []
    seen: set[int] = set()
    for f in outside:
        if f["rank"] in seen or f["after_failed"]:
            continue
        seen.add(f["rank"])
        # One that lost a peer, timed out, or names other ranks follows from a stopped rank, if there is one.
        follows = f["transport"] is not None or bool(set(f["culprits"]) - {f["rank"]})
        # It raised (its process was alive to record it); where, and whether it then left the run.
        where = f"in {f['where']}, outside the lifecycle's transitions" if f["where"] else \
            "outside the lifecycle's transitions"  # fmt: skip
        then = "; it closed its trace on that error and left the run" if f["event"] == TRACE_CLOSED else \
            f" (its {f['event']} record)"  # fmt: skip
        did = "was stopped by a signal sent to its process alone," if f["error"] == SIGNALLED else \
            f"raised {f['error'] or 'an error'}"  # fmt: skip
        headline = (f"rank {f['rank']} {did} {where} (epoch {f['epoch']}){then}"
                    + (f": {f['message']}" if f["message"] else ""))  # fmt: skip
        problems.append(_of_rank(f, Verdict.CRASHED, f["where"], headline, consequence=stopped and follows))
    return problems


def _of_rank(
    entry: OutsideFailure | StoppedRank | StepFailure, verdict: Verdict, transition: str | None, headline: str, *, consequence: bool = False,
    decided: bool = True,
) -> Problem:
    """A problem of one rank, at the position and epoch of its evidence ``entry``."""
    return Problem(verdict=verdict, position=entry["position"], culprits=(entry["rank"],), epoch=entry["epoch"],
                   transition=transition, headline=headline, consequence=consequence, decided=decided)  # fmt: skip


def outside_stop_problems(stops: list[OutsideStop]) -> list[Problem]:
    """Ranks stopped from outside (``evidence.outside_stops``): one problem per reason, blaming nobody.

    An operator's signal, the run's time limit or the launcher's death stops the run where it stood: the
    verdict is ``incomplete`` and no rank is a suspect. A stop after another rank failed is that
    failure's consequence; the failure's own evidence leads.
    """
    problems = []
    by_reason: dict[str, list[OutsideStop]] = {}
    for s in stops:
        by_reason.setdefault(str(s["reason"]), []).append(s)
    for reason, group in by_reason.items():
        first = group[0]
        ranks = plural_ranks(sorted(s["rank"] for s in group))
        why = {
            "signal": f"its launcher got {first['signal'] or 'a signal'} (an operator's or a scheduler's stop) and "
                      f"stopped {ranks}",
            "timeout": f"its launcher stopped {ranks} at the run's time limit",
            "launcher_lost": f"its launcher died, and {ranks} stopped",
            "peer_failed": f"its launcher stopped {ranks} after {plural_ranks(first['failed'])} failed",
        }.get(reason, f"its launcher stopped {ranks}")
        headline = (f"the run was stopped from outside (epoch {first['epoch']}): {why}; no failure recorded before "
                    "that singles out a rank")
        problems.append(Problem(verdict=Verdict.INCOMPLETE, position=first["position"], culprits=(),
                                epoch=first["epoch"], transition=None, headline=headline,
                                consequence=reason == "peer_failed", decided=False))  # fmt: skip
    return problems


def stop_problems(stuck: list[StoppedRank]) -> list[Problem]:
    """Ranks that stopped: crashed, stuck, or silent with nobody waiting on them (incomplete).

    A rank the stop from outside found somewhere (``how == "stopped"``) is no problem of its own: the
    stop is (``outside_stop_problems``).
    """
    problems = []
    for s in stuck:
        how = s["how"]
        if how == "stopped":
            continue
        decided = True
        if how == "left":
            # On its own error: that error is the failure; having finished cleanly: it did another run's length.
            verdict = Verdict.CRASHED if s["closed"] == "unclean" else Verdict.DIVERGENCE
        elif how in _STOP_VERDICTS:
            verdict = _STOP_VERDICTS[how]
        elif how == "unknown" and (s["waited_on_by"] or s["located_by"]):
            verdict = Verdict.STUCK
        else:
            # Cut off while the others finished: it alone stopped. Merely silent (a live run): nobody yet.
            verdict, decided = Verdict.INCOMPLETE, how != "silent"
        problem = _of_rank(s, verdict, s["transition"], s["summary"], decided=decided)
        # Merely silent within the guard timeout (a live run): nothing has failed, so nobody is even a suspect.
        problems.append(dataclasses.replace(problem, culprits=()) if how == "silent" else problem)
    return problems


#: The verdicts are a fixed contract: a rank that cancelled before its guard while its peers waited there
#: stopped while others waited for it (``stuck``); its entry's ``how`` says it cancelled.
_STOP_VERDICTS = {"crashed": Verdict.CRASHED, "stuck": Verdict.STUCK, "cancelled": Verdict.STUCK}


def failure_problems(failures: list[StepFailure], *, stopped_at: int | None) -> list[Problem]:
    """Steps that raised (verification failures are judged apart, by ``corruption``)."""
    problems = []
    for f in failures:
        if f["verification"]:
            continue
        # A peer's crash or hang shows up on the survivors as a failed collective: a consequence.
        consequence = stopped_at is not None and stopped_at <= f["position"] and f["transport"] is not None
        headline = (f"rank {f['rank']} failed in {f['action']} of {f['transition']} (epoch {f['epoch']}): "
                    f"{f['error']}: {first_line(f['message'])}")  # fmt: skip
        problems.append(_of_rank(f, Verdict.CRASHED, f["transition"], headline, consequence=consequence))
    return problems


def corruption(verification: list[VerificationFailure], located: list[LocatedFault]) -> Problem:
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
        decided = True
    else:
        # Nothing traces the data to a rank: which ranks saw which mismatches is no evidence of whose data
        # was wrong (ranks that share a cause can be the many), so it names nobody, as a divergence would not.
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for v in firsts:
            groups[tuple(sorted(set(v["tensors"])))].append(v["rank"])
        culprits, decided = failed, len(failed) == 1
        seen = "the same mismatch" if len(groups) == 1 else "; ".join(
            f"{plural_ranks(rs)}: {_names(names, 3)}" for names, rs in sorted(groups.items(), key=lambda g: g[1]))
        why = "" if decided else (f"; undecided: {plural_ranks(failed)} saw {seen}"
                                  if len(groups) == 1 else f"; undecided: they saw different mismatches ({seen})")
        why += "" if decided else ", and no record traces the data to a rank, so none is singled out"
    return Problem(
        verdict=Verdict.CORRUPT,
        position=first_pos,
        culprits=tuple(culprits),
        epoch=v0["epoch"],
        transition=v0["transition"],
        headline=f"verification failed on {plural_ranks(failed)} in {v0['transition']} (epoch {v0['epoch']}, "
        f"{v0['where']}): {_names(tensors)} changed{why}",
        decided=decided,
    )


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
