"""Which transitions count when ranks are aligned: a transition cancelled before its guard does not.

A rank's transition cancelled before its guard (an anyio timeout or cancel
scope while it planned) entered no collective: its peers never saw it, and
the loop usually fires the same trigger again. Counted as an attempt, it
would shift every later position of that rank by one against its peers,
and a healthy run would read as a divergence. Alignment (the divergence
search, the stragglers, the "ended at another point" check) therefore
compares ranks over their *counted* transitions: those that reached their
guard, or are still before it with nothing cancelled. What the cancellation
itself means when peers then waited for the rank is judged apart
(``miles_fsm.replay.stopped``), on the rank's own trace.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence

from miles_fsm.replay.model import CANCELLED, Note, RankTrace

__all__ = ["counted", "counted_all"]

_CANCELLED = CANCELLED[0]


def counted(t: RankTrace) -> RankTrace:
    """``t`` with its transitions cancelled before their guard left out (``t`` itself if it has none).

    Positions after a dropped one move down; notes recorded at a dropped position go with it.
    """
    if _CANCELLED not in t.outcome:
        return t
    keep = [i for i, code in enumerate(t.outcome) if code != _CANCELLED]
    dropped_before = [0] * (t.positions + 1)  # dropped_before[p]: cancelled positions before p
    for i, code in enumerate(t.outcome):
        dropped_before[i + 1] = dropped_before[i] + (code == _CANCELLED)
    notes = [_moved(n, dropped_before) for n in t.notes if not _at_dropped(t, n.position)]
    opened = t.open
    if opened is not None:
        opened = dataclasses.replace(opened, index=opened.index - dropped_before[min(opened.index, t.positions)])
    return dataclasses.replace(
        t,
        epochs=array(t.epochs.typecode, (t.epochs[i] for i in keep)),
        sigs=array(t.sigs.typecode, (t.sigs[i] for i in keep)),
        guards=array(t.guards.typecode, (t.guards[i] for i in keep)),
        work_s=array(t.work_s.typecode, (t.work_s[i] for i in keep)),
        outcome=bytearray(t.outcome[i] for i in keep),
        notes=notes,
        open=opened,
    )


def _at_dropped(t: RankTrace, position: int) -> bool:
    return 0 <= position < t.positions and t.outcome[position] == _CANCELLED


def _moved(n: Note, dropped_before: list[int]) -> Note:
    at = min(max(n.position, 0), len(dropped_before) - 1)
    return dataclasses.replace(n, position=n.position - dropped_before[at])


def counted_all(traces: Sequence[RankTrace]) -> list[RankTrace]:
    """Every rank's counted transitions (``counted``)."""
    return [counted(t) for t in traces]
