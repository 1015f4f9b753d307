"""Whom to suspect when ranks disagree: one rule, used by the live guard and by replay alike.

The rule, in order:

1. **Evidence.** If the value every rank agreed on the last time this
   trigger passed its guard is known, the ranks whose value changed since
   are the suspects, as long as some rank kept it. (The seed's bug: a rank
   that alone stopped backing up a frozen param changed its tensor set.)
2. **A unique minority.** Otherwise the ranks of the one smallest group.
3. **A tie.** Otherwise nothing tells the sides apart; every rank of the
   tied groups is suspect, and the verdict says it is a tie.

The guard and replay see the same groups and the same history, so they
name the same ranks for the same reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Suspects", "suspects"]


@dataclass(frozen=True, slots=True)
class Suspects:
    """Who is suspect, and how that was decided: ``changed``, ``minority`` or ``tie``."""

    ranks: tuple[int, ...]
    how: str
    reason: str

    @property
    def tie(self) -> bool:
        return self.how == "tie"


def suspects(groups: Mapping[str, Sequence[int]], *, previous: str | None = None) -> Suspects:
    """The suspects among ``groups`` (value -> ranks holding it), given the last agreed value, if known."""
    if previous is not None and previous in groups:
        changed = sorted(r for value, ranks in groups.items() if value != previous for r in ranks)
        if changed:
            return Suspects(tuple(changed), "changed", "they changed it since the last time every rank agreed")
    sizes = sorted(len(r) for r in groups.values())
    if len(sizes) > 1 and sizes[0] < sizes[1]:
        minority = min(groups.values(), key=len)
        return Suspects(tuple(sorted(minority)), "minority", "they are the only ranks that hold this value")
    tied = sorted(r for ranks in groups.values() if len(ranks) == sizes[0] for r in ranks)
    return Suspects(
        tuple(tied),
        "tie",
        "a tie: equally many ranks on each side and no earlier agreement to tell which side changed",
    )
