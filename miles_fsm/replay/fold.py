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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import orjson

from miles_fsm.replay.checks import I64, bad_action
from miles_fsm.replay.fold_state import CLOSED, OUT, SKIPPED, FoldState
from miles_fsm.replay.hot import HOT_EVENTS, decode_hot, hot_errors
from miles_fsm.replay.model import FINISHED, OPEN, UNCLOSED, EpochRange, RankTrace
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
    # The hot loop keeps its state in locals: it runs once per line of every rank. What only the rare
    # records touch (the machine's table, the run, the identity, notes, bad lines) is in ``st``.
    st = FoldState(t, path, epochs, want_run, run_known)
    loads, hot, nan, rank, version = orjson.loads, HOT_EVENTS, math.nan, t.rank, SCHEMA_VERSION
    run0, world0 = st.run0, st.world0  # copies of st's, read again after st changes them
    epochs_append, sigs_append, guards_append = t.epochs.append, t.sigs.append, t.guards.append
    sig_ids, guard_ids, checked, machine, pending, table = st.sig_ids, st.guard_ids, st.checked, None, None, None
    work_append, outcome = t.work_s.append, t.outcome
    # The open transition: its line (0: none), sig id, guard id (-1: no guard record yet), phase, and its
    # transition_started line, parsed only if it stays open.
    cur_line, cur_epoch, cur_sig, cur_guard, cur_guard_s, cur_phase, cur_raw = 0, -1, 0, -1, 0.0, "", b""
    last_action_line, last_action, last_action_event, last_parsed_line = 0, None, "", 0
    last_raw = prev_raw = b""  # the last record's line, and the one before (what a rank did before trace_closed)
    # seq - line + lines skipped, at the last parsed record: it never falls from one record to the next
    # (it rises by the records lost), unless the lines are out of seq order.
    offset, lo, hi, skipped, lineno = -1, -I64, I64, 0, 0

    def close(code: bytes, work: float) -> None:
        # No guard record: skipped (no collectives) once steps ran or the transition
        # closed; unknown (-1) while it may still be planning.
        g = cur_guard if cur_guard >= 0 or (code == OPEN and cur_phase == "planning") else 0
        epochs_append(cur_epoch)
        sigs_append(cur_sig)
        guards_append(g)
        work_append(work)
        outcome.extend(code)

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
                    world0 = st.identity(lineno, h.v, h.rank, h.world)
            else:
                h = None
                if (parsed := st.parse(line, lineno, complete)) is None:
                    skipped += 1
                    continue
                rec, event, seq = parsed
                world0 = st.world0
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
                    st.bad(lineno, f"not a trace record: {why}", line)
                    continue
                last_action_line, last_action, last_action_event = lineno, act, event
            elif event == TRANSITION_STARTED:
                if h is not None:
                    sig = (h.trigger, h.state, h.dest, tuple(h.steps) if h.steps.__class__ is list else ())
                else:
                    steps = rec.get("steps")
                    sig = (rec.get("trigger"), rec.get("state"), rec.get("dest"),
                           tuple(steps) if steps.__class__ is list else ())  # fmt: skip
                try:
                    sig_id = sig_ids.get(sig, -1)
                except TypeError:  # a list or an object where a name belongs: reported as a bad line below
                    sig_id = -1
                if sig_id < 0 and (sig_id := st.new_sig(sig, lineno, line)) < 0:
                    skipped += 1
                    continue
                if cur_line:
                    close(UNCLOSED, nan)
                epoch = h.epoch if h is not None else rec.get("epoch")
                cur_epoch = epoch if epoch.__class__ is int and lo <= epoch < hi else -1
                cur_line, cur_sig, cur_guard, cur_guard_s, cur_phase = lineno, sig_id, -1, 0.0, "planning"
                cur_raw = line
                if machine is None:
                    machine = sig[1]
                if table is None:
                    pending = sig[2]  # no table to check against: the trace is believed
                else:  # what the table says of this transition from here: (why it is illegal or None, its dest)
                    verdict, pending = checked.get((machine, sig_id)) or st.check(machine, sig_id, sig)
                    if verdict is not None:
                        st.illegal(lineno, rec if rec is not None else loads(line), verdict, len(outcome))
            elif event == TRANSITION_FINISHED:
                state = h.state if h is not None else rec.get("state")
                if state is not None and state.__class__ is not str:
                    skipped += 1
                    st.bad(lineno, "not a trace record: state is not a name", line)
                    continue
                if cur_line:
                    d = h.duration_s if h is not None else rec.get("duration_s")
                    close(FINISHED, d - cur_guard_s if d.__class__ is float else nan)
                if not cur_line or (pending is not None and state != pending):
                    st.finished_oddly(lineno, rec, line, state, pending, len(outcome) - 1, was_open=cur_line != 0)
                cur_line, machine, pending = 0, state, None
            elif event == GUARD_ENTERED:
                if cur_line:
                    if h is not None:
                        cols, key, tensors = h.collectives, h.key, h.tensors
                    else:
                        cols, key, tensors = rec.get("collectives"), rec.get("key"), rec.get("tensors")
                    g = (key, tuple(cols) if cols.__class__ is list else (), tensors)
                    try:
                        guard_id = guard_ids.get(g, -1)
                    except TypeError:  # a list or an object where a name belongs: reported as a bad line below
                        guard_id = -1
                    if guard_id < 0 and (guard_id := st.new_guard(g, lineno, line)) < 0:
                        skipped += 1
                        continue
                    cur_guard, cur_phase = guard_id, "guard"
            elif event == GUARD_PASSED:
                if cur_line:
                    d = h.duration_s if h is not None else rec.get("duration_s")
                    cur_guard_s, cur_phase = (d if d.__class__ is float else 0.0), "between steps"
            elif event == VERIFIED:
                t.verified += 1
            else:
                st.machine, st.pending = machine, pending
                if (done := st.rare(event, rec, lineno, line, cur_line, skipped, prev_raw, close)) == OUT:
                    return False
                skipped += done & SKIPPED
                cur_line = 0 if done & CLOSED else cur_line
                run0, machine, pending, table = st.run0, st.machine, st.pending, st.table
    if not st.end(lineno, skipped, last_parsed_line, last_raw):
        return False
    if cur_line:
        cur_phase = st.left_open(cur_raw, cur_epoch, cur_phase, len(outcome), last_action_line > cur_line, last_action,
                                 last_action_event)  # fmt: skip
        close(OPEN, nan)
    return True
