"""Whom to suspect when ranks disagree: one rule, used by the live guard and by replay alike.

The rule, in order:

1. **Evidence.** If the value every rank agreed on the last time this
   trigger passed its guard is known, the ranks whose value changed since
   are the suspects, as long as some rank kept it. (The seed's bug: a rank
   that alone stopped backing up a frozen param changed its tensor set.)
   This is the only rule that decides.
2. **A tie.** Otherwise, with equally many ranks on each side, nothing tells
   the sides apart: every rank of the differing groups is suspect.
3. **Undecided.** Otherwise one side is smaller, but that is no evidence:
   ranks that share a cause (a config, a node, a code path taken on a rank
   subset) can be the many, and the one healthy rank the few. Every rank of
   the differing groups is suspect, and the reason names the smaller side.

Only ``changed`` singles ranks out (``Suspects.decided``); a tie and an
undecided split say so plainly, and name nobody as *the* culprit. The guard
and replay see the same groups and the same history, so they name the same
ranks for the same reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_fsm.errors.guard import DivergenceKind
from miles_fsm.ranks import plural_ranks

__all__ = ["Suspects", "suspects"]


@dataclass(frozen=True, slots=True)
class Suspects:
    """Who is suspect, and how that was decided: ``changed``, ``tie`` or ``undecided``."""

    ranks: tuple[int, ...]
    how: DivergenceKind
    reason: str

    @property
    def tie(self) -> bool:
        return self.how == "tie"

    @property
    def decided(self) -> bool:
        """True when the evidence singles the suspects out (they changed since the last agreement)."""
        return self.how == "changed"


def suspects(groups: Mapping[str, Sequence[int]], *, previous: str | None = None) -> Suspects:
    """The suspects among ``groups`` (value -> ranks holding it), given the last agreed value, if known."""
    if previous is not None and previous in groups:
        changed = sorted(r for value, ranks in groups.items() if value != previous for r in ranks)
        if changed:
            return Suspects(tuple(changed), "changed", "they changed it since the last time every rank agreed")
    every = tuple(sorted(r for ranks in groups.values() for r in ranks))
    sizes = sorted(len(r) for r in groups.values())
    if len(sizes) > 1 and sizes[0] < sizes[1]:
        smallest: Sequence[int] = min(groups.values(), key=len)
        fewer = sorted(smallest)
        return Suspects(
            every,
            "undecided",
            f"undecided: {plural_ranks(fewer)} are fewer, but with no earlier agreement nothing says which side "
            "changed (ranks that share a cause can be the many)",
        )
    return Suspects(
        every,
        "tie",
        "a tie: equally many ranks on each side and no earlier agreement to tell which side changed",
    )
