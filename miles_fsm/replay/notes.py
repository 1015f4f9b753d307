"""Notes a replay adds beside its verdict: what it cannot prove, and what a rogue collective means here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from miles_fsm.ranks import plural_ranks
from miles_fsm.replay.diagnose import Diagnosis, Verdict

__all__ = ["undeclared_note", "unproven_note"]


def unproven_note(unproven: Sequence[Any], of: int) -> str:
    """What replay cannot prove of rank files read without an index (a crashed or live run's, or copied without
    their ``.index``): an edit that leaves every record well-formed and consistent with the others."""
    names = ", ".join(os.path.basename(t.path) for t in unproven[:3]) + (
        f" and {len(unproven) - 3} more" if len(unproven) > 3 else ""
    )
    return (
        f"not provable without the index: {len(unproven)} of {of} rank file(s) ({names}) have no index this "
        "replay can use, so an edit that keeps every record well-formed and consistent (a duration, a clock "
        "reading, a memory figure, a message) cannot be seen; every record's fields, order and agreement with "
        "its transition, the machine and the other ranks were checked"
    )


def undeclared_note(d: Diagnosis, rogue: list[int]) -> str:
    """What a collective outside every plan means here: the likely cause of a hang only where ranks waited."""
    seen = f"the Flight Recorder shows {plural_ranks(rogue)} inside a collective its step's plan did not declare"
    waited = (
        d.verdict in (Verdict.STUCK, Verdict.INCOMPLETE)
        or any(g["error"] == "GuardTimeoutError" for g in d.guard_failures)
        or any(f["transport"] == "timeout" for f in [*d.failures, *d.outside_failures])
    )
    return f"{seen}: the likely cause of the hang" if waited else f"{seen} (nothing waited on it: no rank timed out)"
