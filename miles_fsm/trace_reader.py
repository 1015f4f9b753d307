"""Streaming reader of per-rank JSONL traces, folded into one compact summary per rank.

A rank file is read in blocks and never held whole. Action records are most of
a trace and only the last one matters to the diagnosis (what a stopped rank
was inside), so they are recognised by a byte search and not parsed. Every
other record is parsed with orjson and folded into per-position arrays: the
n-th transition a rank started is its position n, which is how ranks are
aligned later, by per-rank order and epoch, never by wall time.

The fold also re-drives the machine with the recorded triggers, actions not
run, and notes every transition the machine forbids. The machine is the one
the trace itself names: ``trace_opened`` carries the writer's transition
table (``Definition.describe``), so replay needs no copy of the lifecycle's
code and reads traces of any machine. Ranks fold independently, so
``read_ranks`` can spread them over processes.
"""

from __future__ import annotations

import math
import os
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.schema import TRACE_OPENED

__all__ = [
    "BadLine",
    "EpochRange",
    "Illegal",
    "MachineTable",
    "Note",
    "Position",
    "RankTrace",
    "TraceDirError",
    "find_traces",
    "read_rank",
    "read_ranks",
]

_NAME = re.compile(r"^rank-(\d+)\.jsonl$")
_ACTION = b'"event":"action_'
_BLOCK = 1 << 24

#: Outcome codes of a position, one byte each.
FINISHED, FAILED, CANCELLED, OPEN, UNCLOSED = b"F", b"X", b"C", b"O", b"U"

#: Guard fields of a position whose guard was skipped (no collectives planned).
NO_GUARD: tuple[Any, ...] = (None, (), None)


class TraceDirError(ValueError):
    """The trace directory cannot be read or holds no trace: bad input, exit code 2."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRange:
    """Epochs ``first..last`` inclusive; ``last`` None means open-ended."""

    first: int
    last: int | None

    @classmethod
    def parse(cls, text: str) -> "EpochRange":
        """``3`` (one epoch), ``2:5`` or ``2:`` (from 2 on)."""
        lo, sep, hi = text.partition(":")
        try:
            first = int(lo) if lo else 0
            last = (int(hi) if hi else None) if sep else first
        except ValueError:
            raise ValueError(f"--epoch wants N, A:B or A:, got {text!r}") from None
        return cls(first=first, last=last)

    def __contains__(self, epoch: object) -> bool:
        return isinstance(epoch, int) and epoch >= self.first and (self.last is None or epoch <= self.last)


@dataclass(frozen=True, kw_only=True, slots=True)
class BadLine:
    """A line that is not a trace record: reported with file:line, then skipped."""

    path: str
    line: int
    reason: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Illegal:
    """A recorded transition that the machine definition forbids."""

    rank: int
    position: int
    line: int
    seq: int | None
    epoch: int | None
    trigger: str | None
    state: str | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Note:
    """A notable record (a failure, a recovery), kept whole; there are few of them."""

    position: int
    line: int
    event: str
    record: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    """Where a rank's trace ends, or what it was inside when it stopped."""

    index: int
    epoch: int
    trigger: str
    source: str
    phase: str  # "planning", "guard", "step" or "between steps"
    action: str | None
    since_wall: float | None
    since_mono_ns: int | None


@dataclass(kw_only=True, slots=True)
class RankTrace:
    """One rank's trace, folded. Arrays are indexed by position (n-th transition started)."""

    rank: int
    path: str
    world: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    lines: int = 0
    records: int = 0
    max_seq: int = -1
    out_of_order: int = 0
    bad: list[BadLine] = field(default_factory=list)
    truncated: BadLine | None = None
    epochs: array = field(default_factory=lambda: array("q"))
    sigs: array = field(default_factory=lambda: array("l"))
    guards: array = field(default_factory=lambda: array("l"))
    work_s: array = field(default_factory=lambda: array("d"))
    outcome: bytearray = field(default_factory=bytearray)
    sig_table: list[tuple[str, str, str, tuple[str, ...]]] = field(default_factory=list)
    guard_table: list[tuple[Any, ...]] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    illegal: list[Illegal] = field(default_factory=list)
    verified: int = 0
    unknown_events: int = 0
    opened: int = 0
    first_wall: float | None = None
    first_mono_ns: int | None = None
    last_wall: float | None = None
    last_mono_ns: int | None = None
    last_event: str | None = None
    last_seq: int | None = None
    last_line: int = 0
    state: str | None = None
    epoch: int = 0
    open: Position | None = None
    #: The writer's transition table (None: the trace names none; legality is then not checked).
    table: MachineTable | None = None

    @property
    def positions(self) -> int:
        return len(self.outcome)

    @property
    def lost(self) -> int:
        """Records missing by sequence number (garbage lines, a truncated tail, a gap)."""
        return max(0, self.max_seq + 1 - self.records)

    @property
    def strategy(self) -> str | None:
        return self.meta.get("strategy")

    @property
    def guard_timeout_s(self) -> float | None:
        value = self.meta.get("guard_timeout_s")
        return float(value) if isinstance(value, (int, float)) else None

    def trigger_at(self, index: int) -> str:
        return self.sig_table[self.sigs[index]][0]

    def describe_at(self, index: int) -> dict[str, Any]:
        """The intent recorded at a position, field by field (None: not recorded)."""
        trigger, source, dest, steps = self.sig_table[self.sigs[index]]
        g = self.guards[index]
        key, collectives, tensors = (None, None, None) if g < 0 else self.guard_table[g]
        return {
            "epoch": self.epochs[index],
            "trigger": trigger,
            "source state": source,
            "destination": dest,
            "steps": list(steps),
            "guarded": None if g < 0 else key is not None,
            "collectives": None if collectives is None else list(collectives),
            "tensors": tensors,
            "plan fingerprint": key,
        }


# --------------------------------------------------------------------- files


def find_traces(path: str | os.PathLike[str]) -> dict[int, Path]:
    """``rank-<r>.jsonl`` files in a directory, by rank. Rotated ``.jsonl.<n>`` files are older runs."""
    root = Path(path)
    if not root.exists():
        raise TraceDirError(root, "no such directory")
    if not root.is_dir():
        raise TraceDirError(root, "not a directory (give the folder that holds rank-<r>.jsonl)")
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise TraceDirError(root, f"cannot list it ({exc.strerror or exc})") from exc
    found = {int(m.group(1)): root / n for n in names if (m := _NAME.match(n))}
    if not found:
        raise TraceDirError(root, "holds no rank-<r>.jsonl trace files")
    return dict(sorted(found.items()))


def read_ranks(
    files: dict[int, Path], *, epochs: EpochRange | None = None, workers: int | None = None
) -> list[RankTrace]:
    """Fold every rank file; with ``workers`` > 1, in that many processes."""
    items = list(files.items())
    if workers is None:
        workers = _default_workers(files.values())
    if workers <= 1 or len(items) < 2:
        return [read_rank(p, r, epochs=epochs) for r, p in items]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # forkserver: a fork of a threaded parent may deadlock, and spawn re-runs __main__.
    ctx = mp.get_context("forkserver")
    chunk = max(1, len(items) // (workers * 8))
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(_read_item, items, [epochs] * len(items), chunksize=chunk))


def _read_item(item: tuple[int, Path], epochs: EpochRange | None) -> RankTrace:
    return read_rank(item[1], item[0], epochs=epochs)


def _default_workers(paths: Iterable[Path]) -> int:
    # A worker process costs about a second to start (it imports torch through
    # miles_fsm), so spread only when there is far more than that to read.
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            continue  # read_rank reports it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, 8) if total > 256 << 20 else 1


def _blocks(path: Path) -> Iterable[tuple[list[bytes], bool]]:
    """(lines, True) block by block; then ([the incomplete last line], False) if there is one."""
    with open(path, "rb") as f:
        tail = b""
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            lines = (tail + block if tail else block).split(b"\n")
            tail = lines.pop()
            yield lines, True
    if tail:
        yield [tail], False


def _preview(line: bytes) -> str:
    return line[:120].decode("utf-8", "replace")


def iter_lines(path: Path) -> Iterable[tuple[int, bytes, bool]]:
    """(line number, bytes, complete) for each line, read in blocks; the last may be incomplete."""
    lineno = 0
    with open(path, "rb") as f:
        tail = b""
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            for line in lines:
                lineno += 1
                yield lineno, line, True
        if tail:
            yield lineno + 1, tail, False


# ------------------------------------------------------------------- machine


@dataclass(frozen=True, slots=True)
class MachineTable:
    """The writer's transition table, as its ``trace_opened`` record gives it."""

    initial: str
    failed: str
    cycle_states: frozenset[str]
    #: (source, trigger) -> (dest, the steps this rank's plan may run, in order)
    arrows: dict[tuple[str, str], tuple[str, tuple[str, ...]]]

    @classmethod
    def parse(cls, described: Any) -> MachineTable | None:
        """The table of a ``machine`` field, or None if it is missing or malformed."""
        try:
            arrows = {(src, trig): (dest, tuple(str(x) for x in steps))
                      for src, trig, dest, steps in described["transitions"]}  # fmt: skip
            initial, failed = str(described["initial"]), str(described["failed"])
            states = frozenset(str(x) for x in described["states"]) - {initial, failed}
        except (KeyError, TypeError, ValueError):
            return None
        return cls(initial=initial, failed=failed, cycle_states=states, arrows=arrows)

    def allowed(self, state: str | None) -> list[str]:
        return [trig for (src, trig) in self.arrows if src == state]


def _subsequence(part: Sequence[str], whole: Sequence[str]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


# ---------------------------------------------------------------------- fold


def read_rank(path: str | os.PathLike[str], rank: int, *, epochs: EpochRange | None = None) -> RankTrace:
    """Fold one rank's trace file. Unreadable files raise ``TraceDirError``."""
    path = Path(path)
    t = RankTrace(rank=rank, path=str(path))
    try:
        _fold(t, path, epochs)
    except OSError as exc:
        raise TraceDirError(path, f"cannot read it ({exc.strerror or exc})") from exc
    return t


def _fold(t: RankTrace, path: Path, epochs: EpochRange | None) -> None:
    # The hot loop keeps its state in locals: it runs once per line of every rank.
    loads = orjson.loads
    decode_error = orjson.JSONDecodeError
    action = _ACTION
    nan = math.nan
    sig_ids: dict[tuple[Any, ...], int] = {}
    guard_ids: dict[tuple[Any, ...], int] = {NO_GUARD: 0}
    t.guard_table.append(NO_GUARD)
    checked: dict[tuple[Any, ...], str | None] = {}
    epochs_append, sigs_append, guards_append = t.epochs.append, t.sigs.append, t.guards.append
    work_append, outcome = t.work_s.append, t.outcome
    # The open transition: its line (0: none), sig id, guard id (-1: no guard record yet), phase.
    cur_line = 0
    cur_epoch = -1
    cur_sig = 0
    cur_guard = -1
    cur_guard_s = 0.0
    cur_phase = ""
    cur_rec: dict[str, Any] = {}
    # Where the machine is, re-driven from the records; its table comes with trace_opened.
    table: MachineTable | None = None
    machine: str | None = None
    pending: str | None = None
    last_action_line = 0
    last_action = b""
    last_parsed_line = 0
    first_rec: dict[str, Any] | None = None
    last_rec: dict[str, Any] | None = None
    prev_seq = -1
    skipped = 0
    lineno = 0

    def close(code: bytes, work: float) -> None:
        # No guard record: skipped (no collectives) once steps ran or the transition
        # closed; unknown (-1) while it may still be planning.
        g = cur_guard if cur_guard >= 0 or (code == OPEN and cur_phase == "planning") else 0
        epochs_append(cur_epoch)
        sigs_append(cur_sig)
        guards_append(g)
        work_append(work)
        outcome.extend(code)

    def illegal(line: int, rec: dict[str, Any], reason: str, position: int) -> None:
        t.illegal.append(
            Illegal(
                rank=t.rank,
                position=position,
                line=line,
                seq=rec.get("seq"),
                epoch=rec.get("epoch"),
                trigger=rec.get("trigger"),
                state=rec.get("state"),
                reason=reason,
            )
        )

    for lines, complete in _blocks(path):
        for line in lines:
            lineno += 1
            # Action records are most of a trace; only the last one is ever needed.
            if complete and line.rfind(action) >= 0 and line[-1:] == b"}":
                last_action_line = lineno
                last_action = line
                continue
            try:
                rec = loads(line)
                event = rec["event"]
            except decode_error as exc:
                skipped += 1
                if not line or line.isspace():
                    continue
                reason = "truncated last line" if not complete else f"not JSON ({str(exc).split(':')[0]})"
                bad = BadLine(path=str(path), line=lineno, reason=reason, text=_preview(line))
                if complete:
                    t.bad.append(bad)
                else:
                    t.truncated = bad
                continue
            except (KeyError, TypeError, IndexError):
                skipped += 1
                t.bad.append(BadLine(path=str(path), line=lineno, reason="not a trace record", text=_preview(line)))
                continue
            last_parsed_line = lineno
            last_rec = rec
            seq = rec.get("seq")
            if seq.__class__ is int:
                if seq <= prev_seq:
                    t.out_of_order += 1
                else:
                    prev_seq = seq
            if epochs is not None and rec.get("epoch") not in epochs and event != "trace_opened":
                continue
            if event == "transition_started":
                if cur_line:
                    close(UNCLOSED, nan)
                trigger = rec.get("trigger")
                source = rec.get("state")
                dest = rec.get("dest")
                steps = rec.get("steps")
                sig = (trigger, source, dest, tuple(steps) if steps.__class__ is list else ())
                cur_sig = sig_ids.get(sig, -1)
                if cur_sig < 0:
                    cur_sig = sig_ids[sig] = len(t.sig_table)
                    t.sig_table.append(sig)
                epoch = rec.get("epoch")
                cur_epoch = epoch if epoch.__class__ is int else -1
                cur_line, cur_guard, cur_guard_s, cur_phase, cur_rec = lineno, -1, 0.0, "planning", rec
                if machine is None:
                    machine = source
                if table is None:
                    pending = dest  # no table to check against: the trace is believed
                else:
                    key = (machine, cur_sig)
                    verdict = checked.get(key, _UNCHECKED)
                    if verdict is _UNCHECKED:
                        verdict = checked[key] = _check(table, machine, trigger, source, dest, sig[3])
                    if verdict is not None:
                        illegal(lineno, rec, verdict, len(outcome))
                    legal = table.arrows.get((machine, trigger))
                    pending = legal[0] if legal is not None and machine == source else dest
            elif event == "transition_finished":
                state = rec.get("state")
                if cur_line:
                    d = rec.get("duration_s")
                    close(FINISHED, d - cur_guard_s if d.__class__ is float else nan)
                    cur_line = 0
                else:
                    illegal(lineno, rec, "transition_finished without transition_started", len(outcome) - 1)
                if pending is not None and state != pending:
                    illegal(lineno, rec, f"finished in {state}, but the machine moves to {pending}", len(outcome) - 1)
                machine = state
                pending = None
            elif event == "guard_entered":
                if cur_line:
                    cols = rec.get("collectives")
                    g = (rec.get("key"), tuple(cols) if cols.__class__ is list else (), rec.get("tensors"))
                    cur_guard = guard_ids.get(g, -1)
                    if cur_guard < 0:
                        cur_guard = guard_ids[g] = len(t.guard_table)
                        t.guard_table.append(g)
                    cur_phase = "guard"
            elif event == "guard_passed":
                if cur_line:
                    d = rec.get("duration_s")
                    cur_guard_s = d if d.__class__ is float else 0.0
                    cur_phase = "between steps"
            elif event == "verified":
                t.verified += 1
            elif event == "transition_failed" or event == "transition_cancelled":
                _note(t, bool(cur_line), lineno, event, rec)
                if cur_line:
                    close(FAILED if event == "transition_failed" else CANCELLED, nan)
                    cur_line = 0
                else:
                    illegal(lineno, rec, f"{event} without transition_started", len(outcome) - 1)
                if event == "transition_failed":
                    machine = table.failed if table is not None else rec.get("state")
                pending = None
            elif event in ("guard_failed", "verify_failed", "store_unreachable"):
                _note(t, bool(cur_line), lineno, event, rec)
            elif event == "recovered":
                _note(t, bool(cur_line), lineno, event, rec)
                target = rec.get("state")
                if table is None:
                    pass
                elif machine not in (None, table.failed):
                    reason = f"recovered from {machine}, but only {table.failed} can be recovered from"
                    illegal(lineno, rec, reason, len(outcome) - 1)
                elif target not in table.cycle_states:
                    illegal(lineno, rec, f"recovered to {target}, which is not a cycle state", len(outcome) - 1)
                machine = target
            elif event == TRACE_OPENED:
                t.opened += 1
                if t.opened == 1:
                    t.meta = {k: v for k, v in rec.items() if k not in _COMMON}
                    first_rec = rec
                    table = t.table = MachineTable.parse(t.meta.pop("machine", None))
                    if epochs is None and machine is None and table is not None:
                        machine = table.initial
                if rec.get("rank") != t.rank:
                    t.meta["rank_in_records"] = rec.get("rank")
            else:
                t.unknown_events += 1
                # Drivers and the demo may locate a fault themselves (a ``culprits`` list): keep it as evidence.
                culprits = rec.get("culprits")
                if culprits.__class__ is list and culprits:
                    _note(t, bool(cur_line), lineno, event, rec)
    t.records = lineno - skipped
    t.max_seq = prev_seq
    if first_rec is not None or last_rec is not None:
        _track_last(t, first_rec or last_rec, 0)
    if last_rec is not None:
        _track_last(t, last_rec, last_parsed_line)
    if last_action_line > last_parsed_line:
        _track_last(t, loads(last_action), last_action_line)
    if cur_line:
        act = None
        if last_action_line > cur_line:
            rec = loads(last_action)
            act = rec.get("action")
            cur_phase = "step" if rec.get("event") == "action_started" else "between steps"
        epoch = cur_rec.get("epoch")
        t.open = Position(
            index=len(outcome),
            epoch=epoch if isinstance(epoch, int) else -1,
            trigger=str(cur_rec.get("trigger")),
            source=str(cur_rec.get("state")),
            phase=cur_phase,
            action=act,
            since_wall=cur_rec.get("wall"),
            since_mono_ns=cur_rec.get("mono_ns"),
        )
        close(OPEN, nan)


_UNCHECKED = object()
_COMMON = frozenset(("v", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger"))


def _note(t: RankTrace, in_transition: bool, line: int, event: str, rec: dict[str, Any]) -> None:
    # The position a note belongs to: the open transition, else the last one.
    index = len(t.outcome) if in_transition else len(t.outcome) - 1
    t.notes.append(Note(position=index, line=line, event=event, record=rec))


def _track_last(t: RankTrace, rec: dict[str, Any], line: int) -> None:
    wall, mono = rec.get("wall"), rec.get("mono_ns")
    if t.first_wall is None and isinstance(wall, (int, float)):
        t.first_wall, t.first_mono_ns = wall, mono
    if isinstance(wall, (int, float)):
        t.last_wall = wall
    if isinstance(mono, int):
        t.last_mono_ns = mono
    t.last_event = rec.get("event")
    t.last_seq = rec.get("seq")
    t.last_line = line
    if "state" in rec:
        t.state = rec["state"]
    epoch = rec.get("epoch")
    if isinstance(epoch, int):
        t.epoch = epoch
    world = rec.get("world")
    if isinstance(world, int) and (t.world is None or world > t.world):
        t.world = world


def _check(
    table: MachineTable, machine: str | None, trigger: Any, source: Any, dest: Any, steps: tuple[str, ...]
) -> str | None:
    """Why the machine forbids this recorded transition, or None if it allows it."""
    if machine == table.failed:
        return f"{trigger} fired while {table.failed} (no recover in between)"
    legal = table.arrows.get((machine or "", trigger if isinstance(trigger, str) else ""))
    if legal is None:
        allowed = table.allowed(machine)
        return f"no arrow for {trigger} out of {machine} (allowed: {', '.join(allowed) or 'none'})"
    if source != machine:
        return f"recorded source {source}, but the machine is in {machine}"
    if dest != legal[0]:
        return f"recorded destination {dest}, but {trigger} leads to {legal[0]}"
    if not _subsequence(steps, legal[1]):
        return f"steps {list(steps)} are not steps of {trigger} ({', '.join(legal[1])})"
    return None
