"""What the fold keeps beside its hot locals: the rare records' work, and the end of a file.

``miles_fsm.replay.fold`` folds nearly every line (actions, transitions,
guards) in locals of its own loop. Everything else lives here, on a
``FoldState``: the lines that are not the lifecycle's hot records (parsed
with orjson, their identity checked), the bad lines, the machine re-driven
with the recorded triggers, the run, the notes, ``trace_opened`` and
``trace_closed``, and what the file's end leaves to record.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.replay.checks import bad_action, bad_guard, bad_sig, invalid, label, plain_int, schema_problem, unfit
from miles_fsm.replay.consistency import STEP
from miles_fsm.replay.files import preview
from miles_fsm.replay.fold_moves import Moves, known_id
from miles_fsm.replay.model import (
    CANCELLED,
    FAILED,
    NO_GUARD,
    OPEN,
    BadLine,
    EpochRange,
    MachineTable,
    Position,
    RankTrace,
    identity_damage,
)
from miles_fsm.replay.order import bad_line
from miles_fsm.trace.schema import (
    ACTION_STARTED,
    GUARD_FAILED,
    RECOVERED,
    SCHEMA_VERSION,
    STORE_UNREACHABLE,
    TRACE_CLOSED,
    TRACE_OPENED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    VERIFIED,
    VERIFY_FAILED,
)

__all__ = ["FoldState", "Opened", "OtherRun", "known_id"]

#: The open transition, as the fold's loop holds it: its line (0: none), epoch, sig id, guard id, phase.
Opened = tuple[int, int, int, int, str]
#: ``FoldState._rare``'s answer: the lines are not in order, or hold another run (the sorted reader tells).
_OUT = -1
#: ``FoldState._rare``'s answer, bits: the line was skipped (a bad record); the open transition was closed.
_SKIPPED, _CLOSED = 1, 2


class OtherRun(Exception):
    """A rare record says the file holds another run, or its lines are out of order: the sorted reader tells."""

_UNSET = object()
_NO_RUN = object()
_COMMON = frozenset(("v", "run", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger"))
#: Records the reader keeps whole (notes) or re-drives the machine with: their fields are checked first.
_KEPT_WHOLE = frozenset((TRANSITION_FAILED, TRANSITION_CANCELLED, GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE,
                         RECOVERED, TRACE_CLOSED))  # fmt: skip


class FoldState(Moves):
    """One file's fold, beyond the hot loop's locals (its transitions: ``Moves``; its checks: ``Consistency``)."""

    __slots__ = ("t", "path", "epochs", "want_run", "run0", "world0", "foreign", "sig_ids", "guard_ids", "checked",
                 "table", "machine", "pending", "first_rec", "closed_line", "closed_skipped", "_columns", "at", "kinds",
                 "committed")  # fmt: skip

    def __init__(self, t: RankTrace, path: Path, epochs: EpochRange | None, want_run: str | None,
                 run_known: bool) -> None:  # fmt: skip
        self.t, self.path, self.epochs, self.want_run = t, path, epochs, want_run
        # The run of trace_opened (or the one asked for): a record of another run sends the file to the sorted reader.
        self.run0: Any = want_run if run_known else _NO_RUN
        self.world0: Any = _UNSET  # the first record's world: every record must give the same
        # (field, value) -> [records, first line] of records whose identity is not the file's.
        self.foreign: dict[tuple[str, Any], list[int]] = {}
        self.sig_ids: dict[tuple[Any, ...], int] = {}
        self.guard_ids: dict[tuple[Any, ...], int] = {NO_GUARD: 0}
        t.guard_table.append(NO_GUARD)
        #: (machine, sig id) -> where a legal transition takes the machine (an illegal one is checked each time).
        self.checked: dict[tuple[str | None, int], str | None] = {}
        # Where the machine is, re-driven from the records; its table comes with trace_opened.
        self.table: MachineTable | None = None
        self.machine: str | None = None
        self.pending: str | None = None
        self.first_rec: dict[str, Any] | None = None
        self.kinds: dict[str, list[Any]] = {}
        self.step_guard = False
        # The epoch committed last (0 before any transition; None: not known, with --epoch), and where a rare
        # record finds the fold (``Consistency.at``).
        self.committed: int | None = 0 if epochs is None else None
        self.at: tuple[Any, ...] = (None, (), None, self.committed, self.committed)
        self.closed_line = self.closed_skipped = 0
        # Bound once: ``close`` runs once per transition.
        self._columns = (t.epochs.append, t.sigs.append, t.guards.append, t.work_s.append, t.outcome.extend)

    # ------------------------------------------------------------- lines

    def parse(self, line: bytes, lineno: int, complete: bool) -> dict[str, Any] | None:
        """A line that is no hot record: the record, its identity and its fields checked; None if skipped.
        ``OtherRun`` if it is another run's (or comes before any ``trace_opened``)."""
        try:
            rec: dict[str, Any] = orjson.loads(line)
            event = rec["event"]  # raises for anything but an object with an event: no trace record
        except orjson.JSONDecodeError as exc:
            if not line or line.isspace():
                self.bad(lineno, "a blank line (no writer writes one)", line)
            elif complete:
                self.t.bad.append(bad_line(self.path, lineno, line, complete, exc))
            else:
                self.t.truncated = bad_line(self.path, lineno, line, complete, exc)
            return None
        except (KeyError, TypeError, IndexError):
            self.bad(lineno, "not a trace record", line)
            return None
        if event != TRACE_OPENED and rec.get("run") != self.run0:
            raise OtherRun  # another run's record (or one before trace_opened): the sorted reader tells
        identity_of = rec.get("v"), rec.get("rank"), rec.get("world")
        if identity_of != (SCHEMA_VERSION, self.t.rank, self.world0) or not all(x.__class__ is int
                                                                                for x in identity_of):  # fmt: skip
            self.identity(lineno, *identity_of)
        if identity_of[0] == SCHEMA_VERSION and (why := schema_problem(event, rec) if event.__class__ is str
                                                 else "event is not a name") is not None:  # fmt: skip
            self.bad(lineno, f"not a trace record: {why}", line)
            return None
        return rec

    def identity(self, line: int, v: Any, r: Any, world: Any) -> Any:
        """Count a record whose identity differs from the file's (or the first record); the file's world."""
        if self.world0 is _UNSET:
            self.world0 = world
        for name, value, want in (("rank", r, self.t.rank), ("world", world, self.world0), ("v", v, SCHEMA_VERSION)):
            if value.__class__ is not int or value != want:
                n = self.foreign.setdefault((name, label(value) if plain_int(value) is None else value), [0, line])
                n[0] += 1
        return self.world0

    def bad(self, line: int, reason: str, raw: bytes) -> None:
        self.t.bad.append(BadLine(path=str(self.path), line=line, reason=reason, text=preview(raw)))

    def bad_act(self, act: Any, rec: dict[str, Any] | None, lineno: int, line: bytes) -> bool:
        """Whether an action record is bad (noted, and skipped); ``OtherRun`` if a well-formed one is of another run."""
        why = (None if act.__class__ is str else "action is not a name") if rec is None else bad_action(rec)
        if why is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return True
        if rec is not None and rec.get("run") != self.run0:
            raise OtherRun
        return False

    def close(self, code: bytes, work: float, epoch: int, sig: int, guard: int, phase: str) -> None:
        """Record the open transition at its position, with how it ended (``code``) and its own work time."""
        epochs, sigs, guards, work_s, outcome = self._columns
        epochs(epoch)
        sigs(sig)
        # No guard record: skipped (no collectives) once steps ran or the transition
        # closed; unknown (-1) while it may still be planning.
        guards(guard if guard >= 0 or (code == OPEN and phase == "planning") else 0)
        work_s(work)
        outcome(code)

    def new_sig(self, sig: tuple[Any, ...], lineno: int, line: bytes) -> int:
        """A new transition signature's id in ``t.sig_table``; -1 (reported as a bad line) if it is none."""
        why = unfit(sig, bad_sig)
        if why is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return -1
        sig_id = self.sig_ids[sig] = len(self.t.sig_table)
        self.t.sig_table.append(sig)
        return sig_id

    def new_guard(self, g: tuple[Any, ...], lineno: int, line: bytes) -> int:
        """A new guard's (key, collectives, tensors) id in ``t.guard_table``; -1 (a bad line) if it is none."""
        why = unfit(g, bad_guard)
        if why is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return -1
        guard_id = self.guard_ids[g] = len(self.t.guard_table)
        self.t.guard_table.append(g)
        return guard_id

    # ------------------------------------------------------- rare records

    def rare(self, event: Any, rec: dict[str, Any] | None, lineno: int, line: bytes, skipped: int, prev_raw: bytes,
             machine: str | None, pending: str | None, opened: Opened,
             ) -> tuple[int, int, Any, str | None, str | None, MachineTable | None]:  # fmt: skip
        """A record that is none of the hot ones: the fold's open line, lines skipped, run, machine, pending state
        and table after it; ``OtherRun`` if the file holds another run."""
        assert rec is not None  # a HotRecord's event is one of the hot ones
        self.machine, self.pending = machine, pending
        done = self._rare(event, rec, lineno, line, skipped, prev_raw, opened)
        if done == _OUT:
            raise OtherRun
        return (0 if done & _CLOSED else opened[0], skipped + (done & _SKIPPED), self.run0, self.machine, self.pending,
                self.table)  # fmt: skip

    def _rare(self, event: Any, rec: dict[str, Any], lineno: int, line: bytes, skipped: int, prev_raw: bytes,
              opened: Opened) -> int:  # fmt: skip
        """``rare``'s work: ``_OUT``, or the ``_SKIPPED`` and ``_CLOSED`` bits."""
        t, cur_line = self.t, opened[0]
        if event.__class__ is not str:
            self.bad(lineno, "not a trace record: event is not a name", line)
            return _SKIPPED
        if rec.get("run") != self.run0 and event != TRACE_OPENED:
            # Another run's records that keep the seq count going (a restart resets it): read it sorted.
            return _OUT
        if event in _KEPT_WHOLE and (why := invalid(rec)) is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return _SKIPPED
        self.check_rare(event, rec, lineno)
        if event == VERIFIED:
            t.verified += 1
            n = plain_int(rec.get("tensors"))  # a count (the schema is checked), unless the record is of another
            t.verifications.append([len(t.outcome) if cur_line else len(t.outcome) - 1, -1 if n is None else n])
            return 0
        if event == TRANSITION_FAILED or event == TRANSITION_CANCELLED:
            return self._ended(event, rec, lineno, opened, len(t.outcome) - 1)
        if event == GUARD_FAILED and not cur_line:
            self.step_guard = False
        if event in (GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE):
            t.note(bool(cur_line), lineno, event, rec)
        elif event == RECOVERED:
            self._recovered(rec, lineno, cur_line)
        elif event == TRACE_OPENED:
            return self._opened(rec)
        elif event == TRACE_CLOSED:
            if self.step_guard and rec.get("clean") is True:
                self.count(STEP, lineno, "trace_closed clean while a step's guard had not passed")
            t.closed, self.closed_line, self.closed_skipped = rec, lineno, skipped
            if prev_raw:
                t.note_before_close(orjson.loads(prev_raw))
            if rec.get("clean") is not True:
                t.note(bool(cur_line), lineno, event, rec)
        else:
            return self._own(event, rec, lineno, line, cur_line)
        return 0

    def _ended(self, event: str, rec: dict[str, Any], lineno: int, opened: Opened, position: int) -> int:
        """A transition failed or cancelled: closed if open, and the machine FAILED after a failure."""
        cur_line = opened[0]
        self.t.note(bool(cur_line), lineno, event, rec)
        if cur_line:
            self.close(FAILED if event == TRANSITION_FAILED else CANCELLED, math.nan, *opened[1:])
        else:
            self.illegal(lineno, rec, f"{event} without transition_started", position)
        if event == TRANSITION_FAILED:
            self.machine = self.table.failed if self.table is not None else rec.get("state")
        self.pending = None
        return _CLOSED if cur_line else 0

    def _recovered(self, rec: dict[str, Any], lineno: int, cur_line: int) -> None:
        t, table = self.t, self.table
        t.note(bool(cur_line), lineno, RECOVERED, rec)
        target = rec.get("state")
        if table is None:
            pass
        elif self.machine not in (None, table.failed):
            reason = f"recovered from {self.machine}, but only {table.failed} can be recovered from"
            self.illegal(lineno, rec, reason, len(t.outcome) - 1)
        elif target not in table.cycle_states:
            self.illegal(lineno, rec, f"recovered to {target}, which is not a cycle state", len(t.outcome) - 1)
        self.machine = target

    def _opened(self, rec: dict[str, Any]) -> int:
        """``trace_opened``: the run (another is ``_OUT``), and from the first, the meta and the machine's table."""
        t = self.t
        if self.run0 is _NO_RUN:
            self.run0 = rec.get("run")
            if self.want_run is not None and self.run0 != self.want_run:
                return _OUT
        elif rec.get("run") != self.run0:
            return _OUT
        t.opened += 1
        if t.opened == 1:
            t.meta = {k: v for k, v in rec.items() if k not in _COMMON}
            self.first_rec = rec
            t.meta["schema"] = plain_int(rec.get("v"))
            table = self.table = t.table = MachineTable.parse(t.meta.pop("machine", None))
            if self.epochs is None and self.machine is None and table is not None:
                self.machine = table.initial
        return 0

    def _own(self, event: str, rec: dict[str, Any], lineno: int, line: bytes, cur_line: int) -> int:
        """An event the lifecycle does not write: kept when it is a driver's or the demo's own failure."""
        self.t.unknown_events += 1
        # A driver's or the demo's own failure (``error``), or a fault it located itself
        # (a ``culprits`` list): kept as evidence, once its fields are what they claim.
        culprits = rec.get("culprits")
        if (culprits.__class__ is list and culprits) or rec.get("error") is not None:
            why = invalid(rec)
            if why is not None:
                self.bad(lineno, f"not a trace record: {why}", line)
                return _SKIPPED
            self.t.note(bool(cur_line), lineno, event, rec)
        return 0

    # ------------------------------------------------------- end of file

    def end(self, lineno: int, skipped: int, last_parsed_line: int, last_raw: bytes, opened: Opened, cur_raw: bytes,
            last_action: tuple[int, Any, str]) -> bool:  # fmt: skip
        """The file's counts, run, first and last records, identity damage and the transition it ends inside
        (``last_action``: the last action record's line, action and event); False if the last is another run's."""
        if not self._counts(lineno, skipped, last_parsed_line, last_raw):
            return False
        cur_line, epoch, sig, guard, phase = opened
        if cur_line:
            action_line, action, action_event = last_action
            phase = self.left_open(cur_raw, epoch, phase, len(self.t.outcome), action_line > cur_line, action,
                                   action_event)  # fmt: skip
            self.close(OPEN, math.nan, epoch, sig, guard, phase)
        return True

    def _counts(self, lineno: int, skipped: int, last_parsed_line: int, last_raw: bytes) -> bool:
        t = self.t
        last_rec: dict[str, Any] | None = orjson.loads(last_raw) if last_parsed_line else None
        if last_rec is not None and last_rec.get("run") != self.run0:
            return False
        t.lines = lineno
        t.records = lineno - skipped
        t.max_seq = last_rec["seq"] if last_rec is not None else -1
        if self.closed_line:
            t.after_close = (lineno - self.closed_line) - (skipped - self.closed_skipped)
        if self.run0 is not _NO_RUN:
            t.runs = {self.run0: t.records}
            t.run = self.run0
        first = self.first_rec or last_rec
        if first is not None:
            t.track(first, 0)
        if last_rec is not None:
            t.track(last_rec, last_parsed_line)
        identity_damage(t, self.path, self.world0, self.foreign)
        t.damaged.extend(self.inconsistencies(str(self.path)))
        return True

    def left_open(self, cur_raw: bytes, cur_epoch: int, cur_phase: str, index: int, acted: bool, last_action: Any,
                  last_action_event: str) -> str:  # fmt: skip
        """The transition the file ends inside, as ``t.open``; its phase, once its last action is known."""
        act = None
        if acted:
            act = last_action
            cur_phase = "step" if last_action_event == ACTION_STARTED else "between steps"
        cur_rec = orjson.loads(cur_raw)
        wall = cur_rec.get("wall")
        self.t.open = Position(
            index=index,
            epoch=cur_epoch,
            trigger=str(cur_rec.get("trigger")),
            source=str(cur_rec.get("state")),
            phase=cur_phase,
            action=act,
            since_wall=wall if wall.__class__ in (int, float) else None,
            since_mono_ns=plain_int(cur_rec.get("mono_ns")),
        )
        return cur_phase
