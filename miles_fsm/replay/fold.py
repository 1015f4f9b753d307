"""The fold of one rank's trace: its records, in order, into a ``RankTrace``.

Every line is parsed: a line not accounted for could hold anything, and
replay says ok only when every byte is. Action, transition, guard and
verify records of the shape ``Lifecycle`` writes, nearly every line, are
decoded by msgspec into one typed struct (``miles_fsm.replay.hot``); every
other line is parsed with orjson. All are folded into per-position arrays:
the n-th transition a rank started is its position n, which is how ranks
are aligned later, by per-rank order and epoch, never by wall time.

Every record carries its writer's identity: ``v`` (the schema), ``run``,
``rank`` and ``world``. A record whose ``rank``, ``world`` or ``v`` is not
the file's (the file's rank, its first record's world, this reader's schema)
is damage (``Damage``), counted by value with its first line: a copy of
another rank's file reads as one entry, not a line per record. Another
``run`` sends the file to the sorted reader, which keeps one run apart.

The fold also re-drives the machine with the recorded triggers, actions not
run, and notes every transition the machine forbids. The machine is the one
the trace itself names: ``trace_opened`` carries the writer's transition
table (``Definition.describe``), so replay needs no copy of the lifecycle's
code and reads traces of any machine.

The fold trusts line order only as far as the sequence numbers bear it out:
at every record, the lines since the last one must account for the ``seq``
step (a step larger than the lines is lost records; a smaller one is
disorder or a duplicate, or another run). Then it returns False and the
reader sorts the records first: the check costs a few integer operations
per record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    SCHEMA_VERSION,
    GUARD_ENTERED,
    GUARD_FAILED,
    GUARD_PASSED,
    RECOVERED,
    STORE_UNREACHABLE,
    TRACE_CLOSED,
    TRACE_OPENED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
    VERIFIED,
    VERIFY_FAILED,
)
from miles_fsm.replay.checks import I64, MAX_RANKS, bad_action, bad_guard, bad_sig, invalid, label, plain_int
from miles_fsm.replay.files import preview
from miles_fsm.replay.hot import HOT_EVENTS, decode_hot, hot_errors
from miles_fsm.replay.model import (
    CANCELLED,
    FAILED,
    FINISHED,
    NO_GUARD,
    OPEN,
    UNCLOSED,
    BadLine,
    Damage,
    EpochRange,
    Illegal,
    MachineTable,
    Position,
    RankTrace,
)
from miles_fsm.replay.order import bad_line

__all__ = ["fold"]


def fold(
    t: RankTrace, source: Iterable[tuple[list[bytes], bool]], path: Path, epochs: EpochRange | None,
    want_run: str | None,
    *,
    run_known: bool = False,
) -> bool:
    """Fold records in line order; False when their sequence numbers say the lines are not in ``seq`` order,
    or that they hold another run than ``want_run`` (any one run, if None, unless ``run_known``)."""
    # The hot loop keeps its state in locals: it runs once per line of every rank.
    loads = orjson.loads
    hot = HOT_EVENTS
    decode_error = orjson.JSONDecodeError
    nan = math.nan
    rank, version = t.rank, SCHEMA_VERSION
    world0: Any = _UNSET  # the first record's world: every record must give the same
    # (field, value) -> [records, first line] of records whose identity is not the file's.
    foreign: dict[tuple[str, Any], list[int]] = {}
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
    cur_raw = b""  # the open transition's transition_started line, parsed only if it stays open
    # Where the machine is, re-driven from the records; its table comes with trace_opened.
    table: MachineTable | None = None
    machine: str | None = None
    pending: str | None = None
    last_action_line = 0
    last_action: Any = None
    last_action_event = ""
    last_parsed_line = 0
    first_rec: dict[str, Any] | None = None
    last_raw = b""  # the last record's line, parsed once, at the end
    prev_raw = b""  # the one before: what a rank did last before its trace_closed
    # seq - line + lines skipped, at the last parsed record: it never falls from one record to the next
    # (it rises by the records lost), unless the lines are out of seq order.
    offset = -1
    # The run of trace_opened (or the one asked for): a record of another run sends the file to the sorted reader.
    run0: Any = want_run if run_known else _NO_RUN
    closed_line = closed_skipped = 0
    lo, hi = -I64, I64
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
        trigger, state = rec.get("trigger"), rec.get("state")
        t.illegal.append(
            Illegal(rank=t.rank, position=position, line=line, seq=rec.get("seq"), epoch=plain_int(rec.get("epoch")),
                    trigger=label(trigger) if trigger is not None else None,
                    state=label(state) if state is not None else None, reason=reason)  # fmt: skip
        )

    def identity(line: int, v: Any, r: Any, world: Any) -> None:
        # Only called when a record's identity differs from the file's (or on the first record).
        nonlocal world0
        if world0 is _UNSET:
            world0 = world
        for name, value, want in (("rank", r, rank), ("world", world, world0), ("v", v, version)):
            if value.__class__ is not int or value != want:
                n = foreign.setdefault((name, label(value) if plain_int(value) is None else value), [0, line])
                n[0] += 1

    def bad(line: int, reason: str, raw: bytes) -> None:
        t.bad.append(BadLine(path=str(path), line=line, reason=reason, text=preview(raw)))

    for lines, complete in source:
        for line in lines:
            lineno += 1
            try:
                h = decode_hot(line)
            except hot_errors:
                h = None
            if h is not None and h.event in hot:
                rec, event, seq = None, h.event, h.seq
                if h.run != run0:
                    return False  # another run's record, or none opened yet: the sorted reader tells
                if h.rank != rank or h.world != world0 or h.v != version:
                    identity(lineno, h.v, h.rank, h.world)
            else:
                h = None
                try:
                    rec = loads(line)
                    event = rec["event"]
                except decode_error as exc:
                    skipped += 1
                    if not line or line.isspace():
                        continue
                    if complete:
                        t.bad.append(bad_line(path, lineno, line, complete, exc))
                    else:
                        t.truncated = bad_line(path, lineno, line, complete, exc)
                    continue
                except (KeyError, TypeError, IndexError):
                    skipped += 1
                    bad(lineno, "not a trace record", line)
                    continue
                seq = rec.get("seq")
                identity_of = rec.get("v"), rec.get("rank"), rec.get("world")
                if identity_of != (version, rank, world0) or not all(x.__class__ is int for x in identity_of):
                    identity(lineno, *identity_of)
            if seq.__class__ is not int or (k := seq - lineno + skipped) < offset:
                return False
            offset = k
            last_parsed_line = lineno
            prev_raw, last_raw = last_raw, line
            if epochs is not None and (h.epoch if h is not None else rec.get("epoch")) not in epochs \
                    and event != TRACE_OPENED and event != TRACE_CLOSED:  # fmt: skip
                continue
            if event == ACTION_STARTED or event == ACTION_FINISHED:
                # Only the last one matters to the diagnosis (what a stopped rank was inside); each is checked.
                if h is not None:
                    act = h.action
                    why = None if act.__class__ is str else "action is not a name"
                else:
                    act, why = rec.get("action"), bad_action(rec)
                    if why is None and rec.get("run") != run0:
                        return False
                if why is not None:
                    skipped += 1
                    bad(lineno, f"not a trace record: {why}", line)
                    continue
                last_action_line, last_action, last_action_event = lineno, act, event
            elif event == TRANSITION_STARTED:
                if h is not None:
                    trigger, source, dest, steps = h.trigger, h.state, h.dest, h.steps
                else:
                    trigger, source = rec.get("trigger"), rec.get("state")
                    dest, steps = rec.get("dest"), rec.get("steps")
                sig = (trigger, source, dest, tuple(steps) if steps.__class__ is list else ())
                try:
                    sig_id = sig_ids.get(sig, -1)
                except TypeError:  # a list or an object where a name belongs
                    sig_id, why = -1, "a list or an object where a name belongs"
                else:
                    why = bad_sig(sig) if sig_id < 0 else None
                if why is not None:
                    skipped += 1
                    bad(lineno, f"not a trace record: {why}", line)
                    continue
                if sig_id < 0:
                    sig_id = sig_ids[sig] = len(t.sig_table)
                    t.sig_table.append(sig)
                if cur_line:
                    close(UNCLOSED, nan)
                cur_sig = sig_id
                epoch = h.epoch if h is not None else rec.get("epoch")
                cur_epoch = epoch if epoch.__class__ is int and lo <= epoch < hi else -1
                cur_line, cur_guard, cur_guard_s, cur_phase, cur_raw = lineno, -1, 0.0, "planning", line
                if machine is None:
                    machine = source
                if table is None:
                    pending = dest  # no table to check against: the trace is believed
                else:
                    key = (machine, cur_sig)
                    verdict = checked.get(key, _UNCHECKED)
                    if verdict is _UNCHECKED:
                        verdict = checked[key] = table.forbids(machine, trigger, source, dest, sig[3])
                    if verdict is not None:
                        illegal(lineno, rec if rec is not None else loads(line), verdict, len(outcome))
                    legal = table.arrows.get((machine, trigger))
                    pending = legal[0] if legal is not None and machine == source else dest
            elif event == TRANSITION_FINISHED:
                state = h.state if h is not None else rec.get("state")
                if state is not None and state.__class__ is not str:
                    skipped += 1
                    bad(lineno, "not a trace record: state is not a name", line)
                    continue
                if cur_line:
                    d = h.duration_s if h is not None else rec.get("duration_s")
                    close(FINISHED, d - cur_guard_s if d.__class__ is float else nan)
                    cur_line = 0
                else:
                    rec = rec if rec is not None else loads(line)
                    illegal(lineno, rec, "transition_finished without transition_started", len(outcome) - 1)
                if pending is not None and state != pending:
                    rec = rec if rec is not None else loads(line)
                    illegal(lineno, rec, f"finished in {state}, but the machine moves to {pending}", len(outcome) - 1)
                machine = state
                pending = None
            elif event == GUARD_ENTERED:
                if cur_line:
                    if h is not None:
                        cols, key, tensors = h.collectives, h.key, h.tensors
                    else:
                        cols, key, tensors = rec.get("collectives"), rec.get("key"), rec.get("tensors")
                    g = (key, tuple(cols) if cols.__class__ is list else (), tensors)
                    try:
                        guard_id = guard_ids.get(g, -1)
                    except TypeError:  # a list or an object where a name belongs
                        guard_id, why = -1, "a list or an object where a name belongs"
                    else:
                        why = bad_guard(g) if guard_id < 0 else None
                    if why is not None:
                        skipped += 1
                        bad(lineno, f"not a trace record: {why}", line)
                        continue
                    if guard_id < 0:
                        guard_id = guard_ids[g] = len(t.guard_table)
                        t.guard_table.append(g)
                    cur_guard = guard_id
                    cur_phase = "guard"
            elif event == GUARD_PASSED:
                if cur_line:
                    d = h.duration_s if h is not None else rec.get("duration_s")
                    cur_guard_s = d if d.__class__ is float else 0.0
                    cur_phase = "between steps"
            elif event == VERIFIED:
                t.verified += 1
            elif event.__class__ is not str:
                skipped += 1
                bad(lineno, "not a trace record: event is not a name", line)
            elif rec.get("run") != run0 and event != TRACE_OPENED:
                # Another run's records that keep the seq count going (a restart resets it): read it sorted.
                return False
            elif event in _KEPT_WHOLE and (why := invalid(rec)) is not None:
                skipped += 1
                bad(lineno, f"not a trace record: {why}", line)
            elif event == TRANSITION_FAILED or event == TRANSITION_CANCELLED:
                t.note(bool(cur_line), lineno, event, rec)
                if cur_line:
                    close(FAILED if event == TRANSITION_FAILED else CANCELLED, nan)
                    cur_line = 0
                else:
                    illegal(lineno, rec, f"{event} without transition_started", len(outcome) - 1)
                if event == TRANSITION_FAILED:
                    machine = table.failed if table is not None else rec.get("state")
                pending = None
            elif event in (GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE):
                t.note(bool(cur_line), lineno, event, rec)
            elif event == RECOVERED:
                t.note(bool(cur_line), lineno, event, rec)
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
                if run0 is _NO_RUN:
                    run0 = rec.get("run")
                    if want_run is not None and run0 != want_run:
                        return False
                elif rec.get("run") != run0:
                    return False
                t.opened += 1
                if t.opened == 1:
                    t.meta = {k: v for k, v in rec.items() if k not in _COMMON}
                    first_rec = rec
                    t.meta["schema"] = plain_int(rec.get("v"))
                    table = t.table = MachineTable.parse(t.meta.pop("machine", None))
                    if epochs is None and machine is None and table is not None:
                        machine = table.initial
            elif event == TRACE_CLOSED:
                t.closed, closed_line, closed_skipped = rec, lineno, skipped
                if prev_raw:
                    t.note_before_close(loads(prev_raw))
                if rec.get("clean") is not True:
                    t.note(bool(cur_line), lineno, event, rec)
            else:
                t.unknown_events += 1
                # A driver's or the demo's own failure (``error``), or a fault it located itself
                # (a ``culprits`` list): kept as evidence, once its fields are what they claim.
                culprits = rec.get("culprits")
                if (culprits.__class__ is list and culprits) or rec.get("error") is not None:
                    why = invalid(rec)
                    if why is not None:
                        skipped += 1
                        bad(lineno, f"not a trace record: {why}", line)
                    else:
                        t.note(bool(cur_line), lineno, event, rec)
    last_rec: dict[str, Any] | None = loads(last_raw) if last_parsed_line else None
    if last_rec is not None and last_rec.get("run") != run0:
        return False
    t.lines = lineno
    t.records = lineno - skipped
    t.max_seq = last_rec["seq"] if last_rec is not None else -1
    if closed_line:
        t.after_close = (lineno - closed_line) - (skipped - closed_skipped)
    if run0 is not _NO_RUN:
        t.runs = {run0: t.records}
        t.run = run0
    if first_rec is not None or last_rec is not None:
        t.track(first_rec or last_rec, 0)
    if last_rec is not None:
        t.track(last_rec, last_parsed_line)
    _identity_damage(t, path, world0, foreign)
    if cur_line:
        act = None
        if last_action_line > cur_line:
            act = last_action
            cur_phase = "step" if last_action_event == ACTION_STARTED else "between steps"
        cur_rec = loads(cur_raw)
        wall = cur_rec.get("wall")
        t.open = Position(
            index=len(outcome),
            epoch=cur_epoch,
            trigger=str(cur_rec.get("trigger")),
            source=str(cur_rec.get("state")),
            phase=cur_phase,
            action=act,
            since_wall=wall if wall.__class__ in (int, float) else None,
            since_mono_ns=plain_int(cur_rec.get("mono_ns")),
        )
        close(OPEN, nan)
    return True


def _identity_damage(t: RankTrace, path: Path, world: Any, foreign: dict[tuple[str, Any], list[int]]) -> None:
    """The file's world, and its records whose rank, world or schema is not the file's, as damage."""
    t.world = world if world.__class__ is int and 0 < world <= MAX_RANKS else None
    for (name, value), (n, line) in foreign.items():
        if name == "rank":
            what = f"of rank {value}, not rank {t.rank}" + (" (a copy or a link of another rank's file?)"
                                                             if line == 1 and n == t.records else "")  # fmt: skip
        elif name == "world":
            what = f"of world {value}" + ("" if t.world is None else f", not the world {t.world} of its first record")
        else:
            what = f"of schema v{value}; replay reads v{SCHEMA_VERSION}" + (" (v1 traces are never ok)"
                                                                            if value == 1 else "")  # fmt: skip
        t.damaged.append(Damage(path=str(path), line=line, records=n, reason=f"{n} record(s) {what}"))
    if t.world is not None and t.rank >= t.world:
        t.damaged.append(Damage(path=str(path), line=0, records=0,
                                reason=f"rank {t.rank} is beyond the world of {t.world} its records give"))  # fmt: skip


_UNCHECKED = object()
_UNSET = object()
_NO_RUN = object()
_COMMON = frozenset(("v", "run", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger"))
#: Records the reader keeps whole (notes) or re-drives the machine with: their fields are checked first.
_KEPT_WHOLE = frozenset((TRANSITION_FAILED, TRANSITION_CANCELLED, GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE,
                         RECOVERED, TRACE_CLOSED))  # fmt: skip
