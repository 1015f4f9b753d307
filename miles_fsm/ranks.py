"""How sets of ranks are written in reports: ``0-3, 5``, ``rank 4``, ``ranks 1, 3``, ``rank 2 was``.

Every report and error names ranks through these, so the words agree with the count in one place."""

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


def plural_ranks(ranks: Sequence[int], verb: tuple[str, str] | None = None) -> str:
    """``rank 3`` or ``ranks 0-2, 5``; with ``verb`` (singular, plural), followed by the form that agrees:
    ``plural_ranks([2], ("was", "were"))`` is ``rank 2 was``."""
    one = len(set(ranks)) == 1
    text = f"rank {ranks[0]}" if one else f"ranks {rank_ranges(ranks)}"
    return text if verb is None else f"{text} {verb[0] if one else verb[1]}"
