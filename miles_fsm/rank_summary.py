"""Per-rank summaries and the health of the trace files themselves, for the replay report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_fsm.evidence import first_line
from miles_fsm.schema import SCHEMA_VERSION, TRANSITION_FAILED
from miles_fsm.trace_checks import label
from miles_fsm.trace_model import FAILED as OUT_FAILED
from miles_fsm.trace_model import FINISHED, RankTrace

__all__ = ["illegal_json", "rank_json", "trace_problems"]


def trace_problems(
    traces: Sequence[RankTrace],
    missing: list[int],
    *,
    run: str | None = None,
    ignored: Sequence[str] = (),
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """What is wrong with the files themselves: bad lines, lost and duplicate records, other runs' files."""
    bad = [
        {"file": b.path, "line": b.line, "where": b.where, "reason": b.reason, "text": b.text}
        for t in traces
        for b in t.bad
    ]
    truncated = [
        {"file": t.truncated.path, "line": t.truncated.line, "where": t.truncated.where, "rank": t.rank}
        for t in traces
        if t.truncated is not None
    ]
    lost = {str(t.rank): t.lost for t in traces if t.lost}
    duplicates = [{"rank": t.rank, "file": t.path, "seq": d.seq, "line": d.line, "first_line": d.first_line}
                  for t in traces for d in t.duplicates]  # fmt: skip
    warnings = list(warnings)
    for t in traces:
        if t.opened > 1:
            warnings.append(f"{t.path} holds {t.opened} runs (trace_opened {t.opened} times); positions may mix them")
        if t.out_of_order:
            warnings.append(f"{t.path}: {t.out_of_order} record(s) out of sequence order; read in seq order")
        if t.duplicates:
            warnings.append(f"{t.path}: {len(t.duplicates)} exact duplicate record(s) (a seq seen before), dropped")
        if t.after_close:
            warnings.append(f"{t.path}: {t.after_close} record(s) after its trace_closed")
        if "rank_in_records" in t.meta:
            warnings.append(f"{t.path} holds records of rank {t.meta['rank_in_records']}")
        v = t.meta.get("schema")
        if v is not None and v != SCHEMA_VERSION:
            warnings.append(f"{t.path}: schema version {v}; replay reads version {SCHEMA_VERSION}")
    return {
        "bad_lines": bad,
        "truncated": truncated,
        "lost_records": lost,
        "duplicates": duplicates,
        "missing_ranks": missing,
        "run": run,
        "ignored": list(ignored),
        "warnings": warnings,
    }


def illegal_json(i: Any) -> dict[str, Any]:
    return {
        "rank": i.rank,
        "position": i.position,
        "line": i.line,
        "seq": i.seq,
        "epoch": i.epoch,
        "trigger": i.trigger,
        "state": i.state,
        "reason": i.reason,
    }


def rank_json(t: RankTrace) -> dict[str, Any]:
    if t.open is not None:
        status = "open"
    elif t.state == "FAILED":
        status = "failed"
    elif t.positions == 0:
        status = "empty"
    else:
        status = "done"
    out: dict[str, Any] = {
        "rank": t.rank,
        "file": t.path,
        "status": status,
        "state": t.state,
        "epoch": t.epoch,
        "transitions": t.positions,
        "finished": sum(1 for c in t.outcome if c == FINISHED[0]),
        "failed": sum(1 for c in t.outcome if c == OUT_FAILED[0]),
        "last_event": t.last_event,
        "last_seq": t.last_seq,
        "records": t.records,
        "verified": t.verified,
        "closed": None if t.closed is None else "clean" if t.clean else "unclean",
        "host": _scalar(t.meta.get("host")),
        "pid": _scalar(t.meta.get("pid")),
        "strategy": _scalar(t.strategy),
    }
    if t.open is not None:
        out["inside"] = {
            "transition": t.open.trigger,
            "epoch": t.open.epoch,
            "phase": t.open.phase,
            "action": t.open.action,
        }
    fail = next((n.record for n in reversed(t.notes) if n.event == TRANSITION_FAILED), None)
    if fail is not None and t.state == "FAILED":
        out["error"] = {
            "type": fail.get("error"),
            "message": first_line(fail.get("message") or ""),
            "transition": fail.get("trigger"),
            "epoch": fail.get("epoch"),
            "action": fail.get("action"),
        }
    return out


def _scalar(v: Any) -> Any:
    # trace_opened's own fields are shown as written, when they are plain values.
    return v if v is None or v.__class__ in (str, int, float, bool) else label(v)
