"""What the records say failed: guard failures, verification failures, step failures, and failures
outside any transition (a driver's or the demo's own step, or a lifecycle left by an exception).

Each is read from the notes the trace reader kept, with an error's facts from
its ``fields`` (never from its message text), grouped and ordered by the
position they happened at. ``miles_fsm.replay.diagnose`` weighs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_fsm.replay.model import RankTrace
from miles_fsm.replay.shapes import GuardFailure, OutsideFailure, OutsideStop, StepFailure, VerificationFailure
from miles_fsm.trace.schema import (
    GUARD_FAILED,
    RECOVERED,
    STORE_UNREACHABLE,
    TRACE_CLOSED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    VERIFY_FAILED,
    error_fields,
)

__all__ = ["OUTSIDE_STOPS", "SIGNALLED", "guard_failures", "last_own_record", "outside_failures", "outside_stops", "step_failures",
           "verification_failures"]

#: Notes of the lifecycle's own records; any other note is a driver's or the demo's (or an unclean close).
CORE_EVENTS = frozenset(
    (GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE, TRANSITION_FAILED, TRANSITION_CANCELLED, RECOVERED)
)


#: Errors a rank closes its trace with when it was stopped from outside, not by a failure of its own:
#: its launcher stopped it (``miles_fsm.launch.local.RankStoppedError``) or died (``LauncherLostError``).
OUTSIDE_STOPS = frozenset(("RankStoppedError", "LauncherLostError"))
#: A signal sent to one rank's process alone (``miles_fsm.launch.stopping.RankSignalledError``): that rank is the
#: culprit, but it neither raised nor crashed; someone outside the job stopped it.
SIGNALLED = "RankSignalledError"


def stopped_from_outside(t: RankTrace) -> dict[str, Any] | None:
    """The rank's ``trace_closed`` record if it says the rank was stopped from outside, else None."""
    c = t.closed
    return c if c is not None and c.get("clean") is not True and c.get("error") in OUTSIDE_STOPS else None


def last_own_record(t: RankTrace) -> tuple[str | None, str | None, float | None]:
    """The event, subject (action or trigger) and wall clock of the rank's last record of its own: the one
    before the ``trace_closed`` a stop from outside wrote for it, else its last record."""
    b = t.before_close
    if b is not None and not t.after_close and stopped_from_outside(t) is not None:
        return b["event"], b["subject"], b["wall"]
    return t.last_event, t.last_subject, t.last_wall


def outside_stops(traces: Sequence[RankTrace]) -> list[OutsideStop]:
    """Ranks stopped from outside while they ran, and why: an operator's signal to the launcher, the run's
    time limit, another rank's failure, or the launcher's own death. None of these is a rank's fault."""
    out: list[OutsideStop] = []
    for t in traces:
        c = stopped_from_outside(t)
        if c is None:
            continue
        fields = error_fields(c)
        out.append(
            {
                "rank": t.rank,
                "position": t.open.index if t.open is not None else t.positions,
                "epoch": c.get("epoch"),
                "state": c.get("state"),
                "error": c.get("error"),
                "reason": "launcher_lost" if c.get("error") == "LauncherLostError" else fields.get("reason"),
                "signal": fields.get("signal"),
                "failed": sorted(fields.get("failed") or ()),
            }
        )
    out.sort(key=lambda s: (s["position"], s["rank"]))
    return out


def guard_failures(traces: Sequence[RankTrace]) -> list[GuardFailure]:
    """Guard failures grouped by position and error: who failed and what they said."""
    grouped: dict[tuple[int, str], GuardFailure] = {}
    missing: dict[tuple[int, str], set[int]] = {}  # the ranks each group names as missing, sorted at the end
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
                    "missing": [],
                    "field": fields.get("field"),
                    "culprits": fields.get("culprits"),
                    "how": fields.get("how"),
                    "groups": fields.get("groups"),
                    "detail": fields.get("detail"),
                    "message": first_line(rec.get("message") or ""),
                }
            g["ranks"].append(t.rank)
            missing.setdefault(key, set()).update(fields.get("missing") or ())
    for key, g in grouped.items():
        g["ranks"].sort()
        g["missing"] = sorted(missing[key])
    return sorted(grouped.values(), key=lambda g: (g["position"], str(g["error"])))


def verification_failures(traces: Sequence[RankTrace]) -> list[VerificationFailure]:
    out: list[VerificationFailure] = []
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


def step_failures(traces: Sequence[RankTrace]) -> list[StepFailure]:
    """Transitions that failed in a step (an action raised): not the guard's failures."""
    out: list[StepFailure] = []
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


def outside_failures(traces: Sequence[RankTrace]) -> list[OutsideFailure]:
    """Errors recorded outside any transition: a driver's or the demo's record carrying ``error``
    (``demo_failed``), or a ``trace_closed`` written as an exception left the lifecycle.

    ``after_failed``: the rank was already FAILED, so a transition's failure, reported on its own,
    is what this one carries on.
    """
    out: list[OutsideFailure] = []
    for t in traces:
        failed = t.table.failed if t.table is not None else "FAILED"
        for n in t.notes:
            rec = n.record
            if n.event in CORE_EVENTS or (rec.get("error") is None and n.event != TRACE_CLOSED):
                continue
            if n.event == TRACE_CLOSED and stopped_from_outside(t) is not None:
                continue  # stopped from outside: ``outside_stops``, never the rank's own failure
            out.append(
                {
                    "rank": t.rank,
                    "position": n.position,
                    "epoch": rec.get("epoch"),
                    "event": n.event,
                    "where": rec.get("where"),
                    "error": rec.get("error"),
                    "message": first_line(rec.get("message") or ""),
                    "transport": rec.get("transport"),
                    # The ranks it names: a located fault's culprits, or the peers a lifecycle error found missing.
                    "culprits": sorted(set(rec.get("culprits") or error_fields(rec).get("culprits") or ())
                                       | set(error_fields(rec).get("missing") or ())),
                    "after_failed": rec.get("state") == failed,
                    "line": n.line,
                }
            )
    out.sort(key=lambda f: (f["position"], f["rank"], f["line"]))
    return out


def first_line(text: str | None) -> str:
    return text.splitlines()[0] if text else ""
