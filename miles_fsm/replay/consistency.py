"""What a record must agree with besides its own types: its transition, the re-driven machine, the rank's clock.

Without an index (a crashed or live run) the lines are all the evidence, so
every record is held to what the writer could have written there: the
records of a transition carry its epoch, source state and trigger; its
actions are its planned steps, started and finished in order, all of them
before it finishes; a guard comes before the steps; a verification runs
inside a step; a record outside any transition carries the epoch the rank
committed last (or the one it started last, after a failure) and the
state the machine is in; ``trace_opened`` is epoch 0 with no state and a
machine table replay can read; ``mono_ns`` is a 64-bit clock reading that
never goes back. A record that breaks one is damage: counted by kind, with
its first line, never ``ok``.

The fold's loop makes the one comparison that holds in a healthy trace;
only when it fails is a method here called, to say what is wrong.
``Consistency`` is a part of ``FoldState``: it reads the fold's own state
(``t``, ``table``, ``machine``, ``at``) and keeps the counts in ``kinds``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from miles_fsm.replay.checks import label, machine_problem, plain_int
from miles_fsm.replay.hot import UNSET
from miles_fsm.replay.model import UNCLOSED, Damage, MachineTable, RankTrace
from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    CANCEL_DEFERRED,
    EVENTS,
    GUARD_ENTERED,
    GUARD_FAILED,
    GUARD_PASSED,
    MEMORY_DRIFT,
    MEMORY_SNAPSHOT,
    RECOVERED,
    STORE_UNREACHABLE,
    TRACE_CLOSED,
    TRACE_OPENED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    TRANSITION_FINISHED,
    VERIFIED,
    VERIFY_FAILED,
)

__all__ = ["Consistency"]

OUTSIDE = "of a transition's kind, outside any transition"
EPOCH = "with an epoch other than their transition's, or than the rank's outside one"
STATE = "with a state other than the re-driven machine's"
TRIGGER = "with a trigger other than their transition's"
STEP = "out of the order of their transition's planned steps"
MISSING = "without a field the schema gives their event"
CLOCK = "whose mono_ns is not a 64-bit clock reading that never goes back"
OPENED = "of trace_opened that are not epoch 0 with a null state and trigger"
TABLE = "of trace_opened with a machine table replay cannot read (legality is then not checked)"
#: Events written inside a transition, with its epoch, trigger and (but for a failure) source state.
_OF_TRANSITION = frozenset((TRANSITION_FAILED, TRANSITION_CANCELLED, VERIFIED, VERIFY_FAILED))
#: Events that carry the state the machine is in; null triggers.
_AT_STATE = frozenset((TRACE_CLOSED, MEMORY_SNAPSHOT, MEMORY_DRIFT))


def _shown(v: Any) -> str:
    """A value a record holds, to name in a reason: a name or a 64-bit integer as itself, else its kind."""
    return str(v) if v is None or plain_int(v) is not None else label(v)


class Consistency:
    """``FoldState``'s checks of each record against its transition, the machine and the clock."""

    __slots__ = ()
    t: RankTrace
    table: MachineTable | None
    machine: str | None
    #: The fold's position when a rare record comes: (open transition's epoch, state, trigger or None, its
    #: planned steps, the action running, the epoch committed last, the one started last).
    at: tuple[Any, ...]
    #: kind -> [records, first line, what the first one holds]
    kinds: dict[str, list[Any]]
    close: Callable[..., None]
    epochs: Any

    def count(self, kind: str, line: int, detail: str) -> None:
        n = self.kinds.setdefault(kind, [0, line, detail])
        n[0] += 1

    def clock(self, line: int, mono: Any, last: int) -> int:
        """A ``mono_ns`` that is no reading, or goes back: counted; the clock stays at ``last``."""
        self.count(CLOCK, line, f"mono_ns {_shown(mono)}" + ("" if mono.__class__ is not int else f" after {last}"))
        return last

    def odd(self, line: int, h: Any, cur: Any, steps: tuple[str, ...], next_step: Any, act_open: Any) -> None:
        """Why a record of the open transition (an action, a guard, its end) is not of it."""
        event = h.event
        if cur is None:
            self.count(OUTSIDE, line, f"{_shown(event)}")
            return
        epoch, state, trigger = cur
        source = h.source if event == TRANSITION_FINISHED else h.state
        for kind, got, want in ((EPOCH, h.epoch, epoch), (STATE, source, state), (TRIGGER, h.trigger, trigger)):
            if got != want:
                self.count(kind, line, f"{event} holds {_shown(got)} in {trigger} (epoch {epoch}) from {state}")
        act = h.action if event in (ACTION_STARTED, ACTION_FINISHED) else None
        if event == ACTION_STARTED and (act_open is not None or act != next_step):
            self.count(STEP, line, f"{act} started while {act_open} ran" if act_open is not None else
                       f"{act} is not the next planned step of {trigger} ({next_step}; planned: {', '.join(steps)})")
        elif event == ACTION_FINISHED and act != act_open:
            self.count(STEP, line, f"{act} finished while {act_open or 'no action'} ran")
        elif event == TRANSITION_FINISHED and (act_open is not None or next_step is not None):
            self.count(STEP, line, f"{trigger} finished before its planned step {act_open or next_step} did")
        missing = [k for k in _OWN.get(event, ()) if getattr(h, k) is UNSET]
        if missing:
            self.count(MISSING, line, f"{event} without {', '.join(missing)}")

    def odd_start(self, line: int, epoch: Any, committed: int | None, opened: tuple[Any, ...]) -> None:
        """A transition started while another was open, or at an epoch the rank could not be at."""
        if opened[0]:
            self.close(UNCLOSED, math.nan, *opened[1:])
            self.count(STEP, line, f"transition_started at line {line} while the one of line {opened[0]} was open")
        if committed is not None and epoch != committed and epoch != committed + 1:
            self.count(EPOCH, line, f"transition_started of epoch {_shown(epoch)} after epoch {committed}")

    def outside(self, line: int, event: Any, fields: tuple[Any, Any, Any, bool], where: tuple[Any, ...]) -> None:
        """A record outside any transition, (epoch, state, trigger, whether it gives an epoch): the epoch committed
        or started last, the machine's state."""
        committed, started, machine = where
        epoch, state, trigger, has_epoch = fields
        known = event in EVENTS
        if (committed is not None and (known or has_epoch) and epoch != committed and epoch != started
                and (self.epochs is None or epoch in self.epochs)):  # fmt: skip
            self.count(EPOCH, line, f"{_shown(event)} holds epoch {_shown(epoch)}; the rank is at {committed}")
        table = self.table
        if event in (STORE_UNREACHABLE, CANCEL_DEFERRED, RECOVERED):
            if table is not None and not table.knows(state):
                self.count(STATE, line, f"{event} holds state {_shown(state)}, not one of the machine's")
        elif machine is not None and (known or state is not None) and state != machine:
            self.count(STATE, line, f"{_shown(event)} holds state {_shown(state)}; the machine is in {machine}")
        if event in _AT_STATE and trigger is not None:
            self.count(TRIGGER, line, f"{event} holds trigger {_shown(trigger)}, not null")

    def check_rare(self, event: str, rec: dict[str, Any], line: int) -> None:
        """A record that is none of the hot ones, against where the fold is (``at``)."""
        cur, steps, act_open, committed, started = self.at
        if event == TRACE_OPENED:
            if rec.get("epoch") != 0 or rec.get("state") is not None or rec.get("trigger") is not None:
                self.count(OPENED, line, f"epoch {_shown(rec.get('epoch'))}, state {_shown(rec.get('state'))}")
            if "machine" in rec and (why := machine_problem(rec["machine"])) is not None:
                self.count(TABLE, line, why)
            return
        if event in _OF_TRANSITION or (event == GUARD_FAILED and cur is not None):
            if cur is None:
                if event == VERIFIED or event == VERIFY_FAILED:
                    self.count(OUTSIDE, line, event)
                return  # a failure or a cancellation without its transition_started is illegal (``_ended``)
            epoch, state, trigger = cur
            if event == TRANSITION_FAILED:
                state = self.table.failed if self.table is not None else rec.get("state")
                if rec.get("source") != cur[1] or (rec.get("action") is not None and rec.get("action") not in steps):
                    self.count(STATE, line, f"transition_failed of {trigger} from {_shown(rec.get('source'))} "
                                            f"in {_shown(rec.get('action'))}")  # fmt: skip
            for kind, key, want in ((EPOCH, "epoch", epoch), (STATE, "state", state), (TRIGGER, "trigger", trigger)):
                if rec.get(key) != want:
                    self.count(kind, line, f"{event} holds {_shown(rec.get(key))} in {trigger} (epoch {epoch})")
            if (event == VERIFIED or event == VERIFY_FAILED) and act_open is None:
                self.count(STEP, line, f"{event} outside any step of {trigger}")
            return
        if event == TRACE_CLOSED and self.epochs is not None:
            return  # the machine was re-driven through the epochs asked for only; the rank closed after all of them
        fields = (rec.get("epoch"), rec.get("state"), rec.get("trigger"), "epoch" in rec)
        self.outside(line, event, fields, (committed, started, self.machine))

    def inconsistencies(self, path: str) -> list[Damage]:
        """What the checks counted, one entry per kind, at its first line."""
        t = self.t
        out = [Damage(path=path, line=line, records=n, reason=f"{n} record(s) {kind}: {detail}")
               for kind, (n, line, detail) in self.kinds.items()]  # fmt: skip
        if not t.opened and t.records:
            out.append(Damage(path=path, line=0, records=0, reason="no trace_opened: its writer writes one first"))
        if self.table is None and t.positions and TABLE not in self.kinds and t.opened:
            out.append(Damage(path=path, line=0, records=0, reason=f"no machine table in trace_opened: its "
                              f"{t.positions} transition(s) are not checked for legality"))  # fmt: skip
        return out


#: The fields of each hot event that must be present (null is a value; absent is damage).
_OWN: dict[str, tuple[str, ...]] = {
    ACTION_STARTED: ("mem_before",),
    ACTION_FINISHED: ("duration_s", "bytes_moved", "host_bytes", "mem_before", "mem_after"),
    TRANSITION_FINISHED: ("source", "duration_s"),
    GUARD_ENTERED: ("key", "collectives", "tensors"),
    GUARD_PASSED: ("duration_s",),
}
