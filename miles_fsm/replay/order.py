"""A rank file's records in ``seq`` order, for the files whose lines are not: the reader's fallback.

Writers put records in ``seq`` order, so the reader folds a file in line
order and only checks that the sequence numbers add up. When they do not
(lines shuffled, duplicated, or of more than one run), the file is read
again here: every line parsed, the records of one run kept, sorted by
``seq``, exact copies dropped and reported. The reader then folds the
sorted lines, and maps what it found back to the file's own line numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.replay.checks import plain_int
from miles_fsm.replay.files import OVERSIZED, iter_lines, preview
from miles_fsm.replay.model import BadLine, Duplicate

__all__ = ["Ordered", "bad_line", "in_seq_order", "records"]

#: ``run`` of no record yet: the first record's run is the one kept when none is asked for.
_ANY = object()


@dataclass(kw_only=True, slots=True)
class Ordered:
    """A file's records of one run in ``seq`` order, and what was wrong with the rest of its lines."""

    lines: list[bytes] = field(default_factory=list)
    #: ``line_of[i]``: the file line of ``lines[i]``.
    line_of: list[int] = field(default_factory=list)
    total_lines: int = 0
    bad: list[BadLine] = field(default_factory=list)
    truncated: BadLine | None = None
    duplicates: list[Duplicate] = field(default_factory=list)
    runs: dict[str | None, int] = field(default_factory=dict)
    run: Any = _ANY
    out_of_order: int = 0


def bad_line(path: Path, line: int, raw: bytes, complete: bool, exc: orjson.JSONDecodeError) -> BadLine:
    """A line that is not JSON, with the reason the report gives for it."""
    if raw is OVERSIZED:
        reason = "a line over 16 MiB (no writer makes one), not read"
    elif not complete:
        reason = "truncated last line"
    else:
        reason = f"not JSON ({str(exc).split(':')[0]})"
    return BadLine(path=str(path), line=line, reason=reason, text=preview(raw))


def in_seq_order(path: Path, run: str | None | object = _ANY) -> Ordered:
    """Parse every line of ``path``; keep the records of ``run`` (default: the first record's), by ``seq``."""
    out = Ordered(run=run)
    keyed: list[tuple[int, int, bytes]] = []
    for lineno, raw, complete in iter_lines(path):
        out.total_lines = lineno
        if not raw or raw.isspace():
            continue
        try:
            rec = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            bad = bad_line(path, lineno, raw, complete, exc)
            if complete:
                out.bad.append(bad)
            else:
                out.truncated = bad
            continue
        reason = _not_a_record(rec)
        if reason is not None:
            out.bad.append(BadLine(path=str(path), line=lineno, reason=reason, text=preview(raw)))
            continue
        rec_run = rec.get("run")
        if rec_run is not None and rec_run.__class__ is not str:
            out.bad.append(BadLine(path=str(path), line=lineno, reason="run is not a string", text=preview(raw)))
            continue
        out.runs[rec_run] = out.runs.get(rec_run, 0) + 1
        if out.run is _ANY:
            out.run = rec_run
        if rec_run == out.run:
            keyed.append((rec["seq"], lineno, raw))
    if out.run is _ANY:
        out.run = None
    late = 0
    top = -1
    for seq, _, _ in keyed:
        if seq < top:
            late += 1
        top = max(top, seq)
    out.out_of_order = late
    keyed.sort(key=lambda k: (k[0], k[1]))
    first: tuple[int, int, bytes] | None = None
    for seq, lineno, raw in keyed:
        if first is not None and first[0] == seq:
            if raw == first[2]:
                out.duplicates.append(Duplicate(seq=seq, line=lineno, first_line=first[1]))
            else:
                reason = f"another record with seq {seq} (line {first[1]}) came first"
                out.bad.append(BadLine(path=str(path), line=lineno, reason=reason, text=preview(raw)))
            continue
        first = (seq, lineno, raw)
        out.lines.append(raw)
        out.line_of.append(lineno)
    out.bad.sort(key=lambda b: b.line)
    return out


def records(path: Path, *, run: str | None | object = _ANY, ordered: bool = True) -> Iterator[dict[str, Any]]:
    """The records of one run of a rank file, parsed: in line order when ``ordered`` (the file's lines
    are in ``seq`` order, as the reader found), else sorted by ``seq``. Lines that are not records are skipped."""
    if ordered:
        for _, raw, _ in iter_lines(path):
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # the analysis reports bad lines with file:line
            if isinstance(rec, dict):
                yield rec
        return
    for raw in in_seq_order(path, run).lines:
        yield orjson.loads(raw)


def _not_a_record(rec: Any) -> str | None:
    if not isinstance(rec, dict) or rec.get("event").__class__ is not str:
        return "not a trace record"
    if plain_int(rec.get("seq")) is None or rec["seq"] < 0:
        return "not a trace record (no sequence number)"
    return None

