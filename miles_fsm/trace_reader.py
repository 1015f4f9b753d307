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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.schema import (
    ACTION_STARTED,
    GUARD_ENTERED,
    GUARD_FAILED,
    GUARD_PASSED,
    RECOVERED,
    STORE_UNREACHABLE,
    TRACE_OPENED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
    VERIFIED,
    VERIFY_FAILED,
)
from miles_fsm.trace_files import blocks, default_workers, preview
from miles_fsm.trace_model import (
    CANCELLED,
    FAILED,
    FINISHED,
    NO_GUARD,
    OPEN,
    UNCLOSED,
    BadLine,
    EpochRange,
    Illegal,
    MachineTable,
    Note,
    Position,
    RankTrace,
    TraceDirError,
)

__all__ = ["read_rank", "read_ranks"]

_ACTION = b'"event":"action_'


def read_ranks(
    files: dict[int, Path], *, epochs: EpochRange | None = None, workers: int | None = None
) -> list[RankTrace]:
    """Fold every rank file; with ``workers`` > 1, in that many processes."""
    items = list(files.items())
    if workers is None:
        workers = default_workers(files.values())
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


def _subsequence(part: Sequence[str], whole: Sequence[str]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)



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

    for lines, complete in blocks(path):
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
                bad = BadLine(path=str(path), line=lineno, reason=reason, text=preview(line))
                if complete:
                    t.bad.append(bad)
                else:
                    t.truncated = bad
                continue
            except (KeyError, TypeError, IndexError):
                skipped += 1
                t.bad.append(BadLine(path=str(path), line=lineno, reason="not a trace record", text=preview(line)))
                continue
            last_parsed_line = lineno
            last_rec = rec
            seq = rec.get("seq")
            if seq.__class__ is int:
                if seq <= prev_seq:
                    t.out_of_order += 1
                else:
                    prev_seq = seq
            if epochs is not None and rec.get("epoch") not in epochs and event != TRACE_OPENED:
                continue
            if event == TRANSITION_STARTED:
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
            elif event == TRANSITION_FINISHED:
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
            elif event == GUARD_ENTERED:
                if cur_line:
                    cols = rec.get("collectives")
                    g = (rec.get("key"), tuple(cols) if cols.__class__ is list else (), rec.get("tensors"))
                    cur_guard = guard_ids.get(g, -1)
                    if cur_guard < 0:
                        cur_guard = guard_ids[g] = len(t.guard_table)
                        t.guard_table.append(g)
                    cur_phase = "guard"
            elif event == GUARD_PASSED:
                if cur_line:
                    d = rec.get("duration_s")
                    cur_guard_s = d if d.__class__ is float else 0.0
                    cur_phase = "between steps"
            elif event == VERIFIED:
                t.verified += 1
            elif event == TRANSITION_FAILED or event == TRANSITION_CANCELLED:
                _note(t, bool(cur_line), lineno, event, rec)
                if cur_line:
                    close(FAILED if event == TRANSITION_FAILED else CANCELLED, nan)
                    cur_line = 0
                else:
                    illegal(lineno, rec, f"{event} without transition_started", len(outcome) - 1)
                if event == TRANSITION_FAILED:
                    machine = table.failed if table is not None else rec.get("state")
                pending = None
            elif event in (GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE):
                _note(t, bool(cur_line), lineno, event, rec)
            elif event == RECOVERED:
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
                    t.meta["schema"] = rec.get("v")
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
            cur_phase = "step" if rec.get("event") == ACTION_STARTED else "between steps"
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
    subject = rec.get("action") or rec.get("trigger")
    t.last_subject = subject if isinstance(subject, str) else None
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
