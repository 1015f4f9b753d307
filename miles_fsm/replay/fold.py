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

The loop here holds only what nearly every line takes; the rare records,
the bad lines and the end of a file are ``miles_fsm.replay.fold_state``'s.
A line orjson read is seen through a ``RecordView``, so the loop reads the
same fields of either kind of line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from miles_fsm.replay.checks import I64
from miles_fsm.replay.fold_state import FoldState, OtherRun, known_id
from miles_fsm.replay.hot import HOT_EVENTS, NOT_HOT, HotRecord, RecordView, decode_hot, hot_errors
from miles_fsm.replay.model import UNCLOSED, EpochRange, RankTrace
from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    GUARD_ENTERED,
    GUARD_PASSED,
    SCHEMA_VERSION,
    TRACE_CLOSED,
    TRACE_OPENED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
    VERIFIED,
)

__all__ = ["fold"]


def fold(
    t: RankTrace, source: Iterable[tuple[list[bytes], bool]], path: Path, epochs: EpochRange | None,
    want_run: str | None,
    *,
    run_known: bool = False,
) -> bool:
    """Fold records in line order; False when their sequence numbers say the lines are not in ``seq`` order,
    or that they hold another run than ``want_run`` (any one run, if None, unless ``run_known``)."""
    try:
        return _loop(FoldState(t, path, epochs, want_run, run_known), source, epochs)
    except OtherRun:  # a rare record of another run: the sorted reader tells
        return False


def _loop(st: FoldState, source: Iterable[tuple[list[bytes], bool]], epochs: EpochRange | None) -> bool:
    """``fold``'s loop. It runs once per line of every rank, so its state is in locals (``st``'s copied, and read
    again after ``st`` changes them); what only the rare records touch (the table, notes, bad lines) is ``st``'s."""
    hot, rank, version, close = HOT_EVENTS, st.t.rank, SCHEMA_VERSION, st.close
    sig_ids, guard_ids, checked = st.sig_ids, st.guard_ids, st.checked
    run0, world0, machine, pending, table = st.run0, st.world0, st.machine, st.pending, st.table
    h: HotRecord | RecordView
    # The open transition: line (0: none), epoch, sig, guard (-1: none yet), guard wait, phase, transition_started.
    cur_line, cur_epoch, cur_sig, cur_guard, cur_wait_s, cur_phase, cur_raw = 0, -1, 0, -1, 0.0, "", b""
    last_action_line, last_action, last_action_event, last_parsed_line = 0, None, "", 0
    last_raw = prev_raw = b""  # the last record's line, and the one before (what a rank did before trace_closed)
    # offset: seq - line + lines skipped; it never falls from one record to the next unless the lines are disordered.
    offset, lo, hi, skipped, lineno = -1, -I64, I64, 0, 0
    for lines, complete in source:
        for line in lines:
            lineno += 1
            try:
                h = decode_hot(line)
            except hot_errors:
                h = NOT_HOT
            if h.event in hot:
                rec = None
                if h.run != run0:
                    return False  # another run's record, or none opened yet: the sorted reader tells
                if h.rank != rank or h.world != world0 or h.v != version:
                    world0 = st.identity(lineno, h.v, h.rank, h.world)
            elif (rec := st.parse(line, lineno, complete)) is None:
                skipped += 1
                continue
            else:  # any other line, read by orjson: the same fields, through a view of its dict
                h, world0 = RecordView(rec), st.world0
            event, seq = h.event, h.seq
            if seq.__class__ is not int or (k := seq - lineno + skipped) < offset:
                return False
            offset, last_parsed_line, prev_raw, last_raw = k, lineno, last_raw, line
            if epochs is not None and h.epoch not in epochs and event != TRACE_OPENED and event != TRACE_CLOSED:
                continue
            if event == ACTION_STARTED or event == ACTION_FINISHED:
                if ((act := h.action).__class__ is not str or rec is not None) and st.bad_act(act, rec, lineno, line):
                    skipped += 1
                    continue
                last_action_line, last_action, last_action_event = lineno, act, event  # what a stopped rank was in
            elif event == TRANSITION_STARTED:
                sig = (h.trigger, h.state, h.dest, tuple(steps) if (steps := h.steps).__class__ is list else ())
                sig_id = sig_ids.get(sig, -1) if rec is None else known_id(sig_ids, sig)  # a HotRecord's is hashable
                if sig_id < 0 and (sig_id := st.new_sig(sig, lineno, line)) < 0:
                    skipped += 1
                    continue
                if cur_line:
                    close(UNCLOSED, math.nan, cur_epoch, cur_sig, cur_guard, cur_phase)
                cur_epoch = epoch if (epoch := h.epoch).__class__ is int and lo <= epoch < hi else -1
                cur_line, cur_sig, cur_guard, cur_wait_s, cur_phase, cur_raw = lineno, sig_id, -1, 0.0, "planning", line
                machine = sig[1] if machine is None else machine
                pending = sig[2] if table is None else (
                    checked.get((machine, sig_id)) or st.moves(machine, sig_id, sig, lineno, rec, line))
            elif event == TRANSITION_FINISHED:
                if st.finished(lineno, rec, line, (state := h.state), h.duration_s, pending, cur_line, cur_wait_s,
                               cur_epoch, cur_sig, cur_guard):  # fmt: skip
                    skipped += 1
                    continue
                cur_line, machine, pending = 0, state, None
            elif event == GUARD_ENTERED:
                if cur_line:
                    guard_key = (h.key, tuple(cols) if (cols := h.collectives).__class__ is list else (), h.tensors)
                    guard_id = guard_ids.get(guard_key, -1) if rec is None else known_id(guard_ids, guard_key)
                    if guard_id < 0 and (guard_id := st.new_guard(guard_key, lineno, line)) < 0:
                        skipped += 1
                        continue
                    cur_guard, cur_phase = guard_id, "guard"
            elif event == GUARD_PASSED:
                if cur_line:
                    cur_wait_s, cur_phase = (d if (d := h.duration_s).__class__ is float else 0.0), "between steps"
            elif event == VERIFIED:
                st.t.verified += 1
            else:
                cur_line, skipped, run0, machine, pending, table = st.rare(
                    event, rec, lineno, line, skipped, prev_raw, machine, pending,
                    (cur_line, cur_epoch, cur_sig, cur_guard, cur_phase))
    return st.end(lineno, skipped, last_parsed_line, last_raw, (cur_line, cur_epoch, cur_sig, cur_guard, cur_phase),
                  cur_raw, (last_action_line, last_action, last_action_event))  # fmt: skip
