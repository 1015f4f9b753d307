"""What the records say failed: guard failures, verification failures, step failures.

Each is read from the notes the trace reader kept, with an error's facts from
its ``fields`` (never from its message text), grouped and ordered by the
position they happened at. ``miles_fsm.diagnosis`` weighs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_fsm.schema import GUARD_FAILED, TRANSITION_FAILED, VERIFY_FAILED, error_fields
from miles_fsm.trace_model import RankTrace

__all__ = ["guard_failures", "step_failures", "verification_failures"]


def guard_failures(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Guard failures grouped by position and error: who failed and what they said."""
    grouped: dict[tuple[int, str], dict[str, Any]] = {}
    for t in traces:
        for n in t.notes:
            if n.event != GUARD_FAILED:
                continue
            rec = n.record
            fields = error_fields(rec)
            key = (n.position, rec.get("error") or "?")
            g = grouped.get(key)
            if g is None:
                g = grouped[key] = {
                    "position": n.position,
                    "epoch": rec.get("epoch"),
                    "transition": rec.get("trigger"),
                    "error": rec.get("error"),
                    "ranks": [],
                    "missing": set(),
                    "field": fields.get("field"),
                    "culprits": fields.get("culprits"),
                    "groups": fields.get("groups"),
                    "detail": fields.get("detail"),
                    "message": first_line(rec.get("message") or ""),
                }
            g["ranks"].append(t.rank)
            g["missing"].update(fields.get("missing") or ())
    out = []
    for g in sorted(grouped.values(), key=lambda g: (g["position"], str(g["error"]))):
        g["ranks"].sort()
        g["missing"] = sorted(g["missing"])
        out.append(g)
    return out


def verification_failures(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    out = []
    for t in traces:
        for n in t.notes:
            if n.event == VERIFY_FAILED:
                rec = n.record
                out.append(
                    {
                        "rank": t.rank,
                        "position": n.position,
                        "epoch": rec.get("epoch"),
                        "transition": rec.get("trigger"),
                        "where": rec.get("where") or "trainer",
                        "tensors": list(rec.get("tensors") or ()),
                        "line": n.line,
                    }
                )
    out.sort(key=lambda v: (v["position"], v["rank"]))
    return out


_VERIFY_ERRORS = frozenset(("VerificationError", "TensorSetChangedError"))


def step_failures(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Transitions that failed in a step (an action raised): not the guard's failures."""
    out = []
    for t in traces:
        for n in t.notes:
            rec = n.record
            if n.event != TRANSITION_FAILED or rec.get("phase") != "step":
                continue
            out.append(
                {
                    "rank": t.rank,
                    "position": n.position,
                    "epoch": rec.get("epoch"),
                    "transition": rec.get("trigger"),
                    "action": rec.get("action"),
                    "error": rec.get("error"),
                    "message": rec.get("message"),
                    "transport": rec.get("transport"),
                    "verification": rec.get("error") in _VERIFY_ERRORS,
                }
            )
    out.sort(key=lambda f: (f["position"], f["rank"]))
    return out


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
