"""How sets of ranks are written in reports: ``0-3, 5``, ``rank 4``, ``ranks 1, 3``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["plural_ranks", "rank_ranges"]


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


def plural_ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
