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

Every record is also held to what its writer could have written there
(``miles_fsm.replay.consistency``): its transition's epoch, state and
trigger, its planned steps in order, the epoch and state of the rank
outside a transition, a clock that never goes back. The loop makes the one
comparison that holds in a healthy trace; only a record that fails it
costs more.

The loop here holds only what nearly every line takes; the rare records,
the bad lines and the end of a file are ``miles_fsm.replay.fold_state``'s,
the transitions and guards ``miles_fsm.replay.fold_moves``'.
A line orjson read is seen through a ``RecordView``, so the loop reads the
same fields of either kind of line.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from miles_fsm.replay.checks import I64
from miles_fsm.replay.fold_state import FoldState, OtherRun
from miles_fsm.replay.hot import HOT_EVENTS, NOT_HOT, UNSET, HotRecord, RecordView, decode_hot, hot_errors
from miles_fsm.replay.model import EpochRange, RankTrace
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
    """``fold``'s loop, once per line of every rank: its state is in locals; what only the rare records touch is
    ``st``'s. A record is checked against its transition in one comparison; if it fails, ``st.odd`` says why."""
    hot, rank, version, run0, world0, machine, pending, table = (HOT_EVENTS, st.t.rank, SCHEMA_VERSION, st.run0,
                                                                 st.world0, st.machine, st.pending, st.table)
    h: HotRecord | RecordView
    # The open transition: line (0: none), epoch, sig, guard (-1: none yet), guard wait, phase, transition_started;
    # what its records carry (epoch, state, trigger; None: none open), its planned steps, the next, the one running;
    # the epoch committed last and the one started last (None: not known, under --epoch).
    cur_line, cur_epoch, cur_sig, cur_guard, cur_wait_s, cur_phase, cur_raw = 0, -1, 0, -1, 0.0, "", b""
    cur, steps, step_i, next_step, act_open, committed, started = None, (), 0, None, None, st.committed, st.committed
    last_action_line, last_action, last_action_event, last_parsed_line, last_raw, prev_raw = 0, None, "", 0, b"", b""
    offset, skipped, lineno, last_mono = -1, 0, 0, -I64  # offset: seq - line + lines skipped; never falls in order
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
            mono = h.mono_ns
            last_mono = mono if mono.__class__ is int and last_mono <= mono < I64 else st.clock(lineno, mono, last_mono)
            if epochs is not None and h.epoch not in epochs and event != TRACE_OPENED and event != TRACE_CLOSED:
                continue
            if event == ACTION_STARTED or event == ACTION_FINISHED:
                if ((act := h.action).__class__ is not str or rec is not None) and st.bad_act(act, rec, lineno, line):
                    skipped += 1
                    continue
                if (h.epoch, h.state, h.trigger) != cur or (act != next_step or act_open is not None or h.mem_before is UNSET
                                                            if event == ACTION_STARTED else act != act_open or h.mem_after
                        is UNSET or h.duration_s is UNSET or h.bytes_moved is UNSET or h.host_bytes is UNSET
                        or h.mem_before is UNSET):  # fmt: skip
                    st.odd(lineno, h, cur, steps, next_step, act_open)
                if event == ACTION_STARTED or act != act_open:
                    act_open = act if event == ACTION_STARTED else None
                else:
                    step_i, act_open, next_step = step_i + 1, None, steps[step_i + 1] if step_i + 1 < len(steps) else None
                last_action_line, last_action, last_action_event = lineno, act, event  # what a stopped rank was in
            elif event == TRANSITION_STARTED:
                if (new := st.started(h, rec, lineno, line, machine, committed,
                                      (cur_line, cur_epoch, cur_sig, cur_guard, cur_phase))) is None:  # fmt: skip
                    skipped += 1
                    continue
                cur_line, cur_epoch, cur_sig, cur, steps, next_step, machine, pending = new
                cur_guard, cur_wait_s, cur_phase, cur_raw, step_i, act_open, started = -1, 0.0, "planning", line, 0, None, cur_epoch
            elif event == TRANSITION_FINISHED:
                if st.finished(lineno, rec, line, h, pending, (cur_line, cur_wait_s, cur_epoch, cur_sig, cur_guard),
                               (cur, steps, step_i, act_open, cur_phase)):  # fmt: skip
                    skipped += 1
                    continue
                cur_line, machine, pending, cur, committed = 0, h.state, None, None, cur_epoch if cur_line else committed
            elif event == GUARD_ENTERED or event == GUARD_PASSED:
                if (g := st.guard(event, h, rec, lineno, line, cur, (cur_guard, cur_phase, cur_wait_s, step_i, act_open),
                                  (committed, started, machine))) is None:  # fmt: skip
                    skipped += 1
                    continue
                cur_guard, cur_phase, cur_wait_s = g
            else:
                st.at = (cur, steps, act_open, committed, started)
                cur_line, skipped, run0, machine, pending, table = st.rare(
                    event, rec, lineno, line, skipped, prev_raw, machine, pending,
                    (cur_line, cur_epoch, cur_sig, cur_guard, cur_phase))
                cur = cur if cur_line else None
    return st.end(lineno, skipped, last_parsed_line, last_raw, (cur_line, cur_epoch, cur_sig, cur_guard, cur_phase),
                  cur_raw, (last_action_line, last_action, last_action_event))  # fmt: skip
