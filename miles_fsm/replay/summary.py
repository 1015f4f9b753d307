"""Per-rank summaries and the health of the trace files themselves, for the replay report."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from miles_fsm.replay.checks import label
from miles_fsm.replay.evidence import first_line
from miles_fsm.replay.model import FAILED as OUT_FAILED
from miles_fsm.replay.model import FINISHED, Damage, Illegal, RankTrace
from miles_fsm.replay.shapes import (
    BadLineEntry,
    DamageEntry,
    DuplicateEntry,
    IllegalMove,
    RankStatus,
    RankSummary,
    Scalar,
    TraceProblems,
    TruncatedEntry,
)
from miles_fsm.trace.schema import TRANSITION_FAILED

__all__ = ["damage_json", "illegal_json", "rank_json", "trace_problems", "world_of"]


def world_of(traces: Sequence[RankTrace]) -> int:
    """The world the files' records give: the one most files give (the smallest of a tie), else the highest
    rank + 1. A file named beyond it, or giving another, is damage (``trace_problems``), never a wider world:
    a forged ``rank-1048575.jsonl`` must not make a report of a million missing ranks."""
    worlds = Counter(t.world for t in traces if t.world is not None)
    if worlds:
        top = max(worlds.values())
        return min(w for w, n in worlds.items() if n == top)
    return max((t.rank for t in traces), default=-1) + 1


def _across_files(traces: Sequence[RankTrace], world: int) -> list[Damage]:
    """Files at odds with the others: another world, or a rank beyond the world the others give."""
    out = []
    for t in traces:
        if t.world is not None and t.world != world:
            out.append(Damage(path=t.path, line=0, records=0,
                              reason=f"its records give world {t.world}; the other files give {world}"))  # fmt: skip
        if t.rank >= world and not (t.world is not None and t.rank >= t.world):
            out.append(Damage(path=t.path, line=0, records=0,
                              reason=f"rank {t.rank} is beyond the world of {world} the traces give"))  # fmt: skip
    return out


def damage_json(d: Damage, rank: int | None) -> DamageEntry:
    return {"file": d.path, "rank": rank, "line": d.line, "records": d.records, "where": d.where, "reason": d.reason}


def trace_problems(
    traces: Sequence[RankTrace],
    missing: list[int],
    *,
    run: str | None = None,
    ignored: Sequence[str] = (),
    warnings: Sequence[str] = (),
    world: int | None = None,
    damaged: Sequence[Damage] = (),
) -> TraceProblems:
    """What is wrong with the files themselves: bad lines, lost and duplicate records, other runs' files,
    and damage that parses (``damaged``: the directory's own, such as look-alike names, then each file's)."""
    world = world_of(traces) if world is None else world
    damage = [damage_json(d, None) for d in damaged]
    damage += [damage_json(d, t.rank) for t in traces for d in [*t.damaged, *_across_files([t], world)]]
    bad: list[BadLineEntry] = [
        {"file": b.path, "line": b.line, "where": b.where, "reason": b.reason, "text": b.text}
        for t in traces
        for b in t.bad
    ]
    truncated: list[TruncatedEntry] = [
        {"file": t.truncated.path, "line": t.truncated.line, "where": t.truncated.where, "rank": t.rank}
        for t in traces
        if t.truncated is not None
    ]
    lost = {str(t.rank): t.lost for t in traces if t.lost}
    duplicates: list[DuplicateEntry] = [{"rank": t.rank, "file": t.path, "seq": d.seq, "line": d.line, "first_line": d.first_line}
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
    return {
        "bad_lines": bad,
        "truncated": truncated,
        "lost_records": lost,
        "duplicates": duplicates,
        "damaged": damage,
        "missing_ranks": missing,
        "run": run,
        "ignored": list(ignored),
        "warnings": warnings,
    }


def illegal_json(i: Illegal) -> IllegalMove:
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


def rank_json(t: RankTrace) -> RankSummary:
    status: RankStatus
    if t.open is not None:
        status = "open"
    elif t.state == "FAILED":
        status = "failed"
    elif t.positions == 0:
        status = "empty"
    else:
        status = "done"
    out: RankSummary = {
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


def _scalar(v: Any) -> Scalar:
    # trace_opened's own fields are shown as written, when they are plain values.
    return v if v is None or v.__class__ in (str, int, float, bool) else label(v)
