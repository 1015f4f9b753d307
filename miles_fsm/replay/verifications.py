"""Verification across ranks: where one rank verified a transition, every rank that ran it verified the same count.

Whether a cycle is verified is the run's configuration (``VerifyConfig``),
the same on every rank, and the tensor set is one every rank agreed on at
its guards. So at a transition that finished on several ranks with the
same planned steps, a rank without the ``verified`` record the others have
(removed, and the records after it renumbered), or one that verified
another number of tensors (a count of 0 where the others checked 26), is
damage: nothing a writer could have left. One rank's file alone cannot
show either; the ranks' files together do.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from miles_fsm.ranks import plural_ranks
from miles_fsm.replay.model import FINISHED, Damage, RankTrace

__all__ = ["with_verification_damage"]


def with_verification_damage(traces: Sequence[RankTrace]) -> list[RankTrace]:
    """``traces``, each rank whose verification the others contradict with that damage added."""
    found: dict[int, list[str]] = {}
    counts = {t.rank: _by_position(t) for t in traces}
    for p in sorted({p for c in counts.values() for p in c}):
        verifying = [t for t in traces if p in counts[t.rank]]
        plan = {_plan(t, p) for t in verifying}
        ran = [t for t in traces if _finished(t, p) and _plan(t, p) in plan]
        where = _where(verifying[0], p)
        lacking = [t.rank for t in ran if p not in counts[t.rank]]
        for r in lacking:
            found.setdefault(r, []).append(f"no verified record in {where}, where "
                                           f"{plural_ranks([t.rank for t in verifying])} verified")  # fmt: skip
        tally = Counter(counts[t.rank][p] for t in verifying)
        if len(tally) > 1:
            top = max(tally.values())
            usual = [n for n, k in tally.items() if k == top]
            said = ", ".join(f"{plural_ranks(sorted(t.rank for t in verifying if counts[t.rank][p] == n))} {n}"
                             for n in sorted(tally))  # fmt: skip
            for t in verifying:
                if len(usual) > 1 or counts[t.rank][p] != usual[0]:
                    found.setdefault(t.rank, []).append(f"verified {counts[t.rank][p]} tensor(s) in {where}; "
                                                        f"the ranks verified {said}")  # fmt: skip
    return [_damaged(t, found[t.rank]) if t.rank in found else t for t in traces]


def _by_position(t: RankTrace) -> dict[int, int]:
    """Position -> tensors verified there (a second verification at one position: -1, never a count)."""
    out: dict[int, int] = {}
    for p, n in t.verifications:
        if 0 <= p < t.positions:  # outside any transition: the fold counted it as damage already
            out[p] = -1 if p in out else n
    return out


def _plan(t: RankTrace, p: int) -> tuple[object, ...]:
    trigger, _, _, steps = t.sig_table[t.sigs[p]]
    return trigger, steps


def _finished(t: RankTrace, p: int) -> bool:
    return p < t.positions and t.outcome[p] == FINISHED[0]


def _where(t: RankTrace, p: int) -> str:
    return f"{t.trigger_at(p)} (epoch {t.epochs[p]}, transition #{p})" if p < t.positions else f"transition #{p}"


def _damaged(t: RankTrace, reasons: list[str]) -> RankTrace:
    extra = [Damage(path=t.path, line=0, records=0, reason=reasons[0] + (
        f" (and {len(reasons) - 1} more transition(s) like it)" if len(reasons) > 1 else ""))]  # fmt: skip
    return dataclasses.replace(t, damaged=[*t.damaged, *extra])
