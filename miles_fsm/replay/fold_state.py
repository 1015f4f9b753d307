"""What the fold keeps beside its hot locals: the rare records' work, and the end of a file.

``miles_fsm.replay.fold`` folds nearly every line (actions, transitions,
guards) in locals of its own loop. Everything else lives here, on a
``FoldState``: the lines that are not the lifecycle's hot records (parsed
with orjson, their identity checked), the bad lines, the machine re-driven
with the recorded triggers, the run, the notes, ``trace_opened`` and
``trace_closed``, and what the file's end leaves to record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.replay.checks import MAX_RANKS, bad_guard, bad_sig, invalid, label, plain_int
from miles_fsm.replay.files import preview
from miles_fsm.replay.model import (
    CANCELLED,
    FAILED,
    NO_GUARD,
    BadLine,
    Damage,
    EpochRange,
    Illegal,
    MachineTable,
    Position,
    RankTrace,
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
    VERIFY_FAILED,
)

__all__ = ["CLOSED", "OUT", "SKIPPED", "FoldState"]

#: ``FoldState.rare``'s answer: the lines are not in order, or hold another run (the sorted reader tells).
OUT = -1
#: ``FoldState.rare``'s answer, bits: the line was skipped (a bad record); the open transition was closed.
SKIPPED, CLOSED = 1, 2

_UNSET = object()
_NO_RUN = object()
_COMMON = frozenset(("v", "run", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger"))
#: Records the reader keeps whole (notes) or re-drives the machine with: their fields are checked first.
_KEPT_WHOLE = frozenset((TRANSITION_FAILED, TRANSITION_CANCELLED, GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE,
                         RECOVERED, TRACE_CLOSED))  # fmt: skip


class FoldState:
    """One file's fold, beyond the hot loop's locals."""

    __slots__ = ("t", "path", "epochs", "want_run", "run0", "world0", "foreign", "sig_ids", "guard_ids", "checked",
                 "table", "machine", "pending", "first_rec", "closed_line", "closed_skipped")  # fmt: skip

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
        self.checked: dict[tuple[Any, ...], str | None] = {}
        # Where the machine is, re-driven from the records; its table comes with trace_opened.
        self.table: MachineTable | None = None
        self.machine: str | None = None
        self.pending: str | None = None
        self.first_rec: dict[str, Any] | None = None
        self.closed_line = self.closed_skipped = 0

    # ------------------------------------------------------------- lines

    def parse(self, line: bytes, lineno: int, complete: bool) -> tuple[dict[str, Any], Any, Any] | None:
        """A line that is no hot record: (record, event, seq), its identity checked; None if skipped."""
        try:
            rec = orjson.loads(line)
            event = rec["event"]
        except orjson.JSONDecodeError as exc:
            if not line or line.isspace():
                return None
            if complete:
                self.t.bad.append(bad_line(self.path, lineno, line, complete, exc))
            else:
                self.t.truncated = bad_line(self.path, lineno, line, complete, exc)
            return None
        except (KeyError, TypeError, IndexError):
            self.bad(lineno, "not a trace record", line)
            return None
        identity_of = rec.get("v"), rec.get("rank"), rec.get("world")
        if identity_of != (SCHEMA_VERSION, self.t.rank, self.world0) or not all(x.__class__ is int
                                                                                for x in identity_of):  # fmt: skip
            self.identity(lineno, *identity_of)
        return rec, event, rec.get("seq")

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

    def new_sig(self, sig: tuple[Any, ...], lineno: int, line: bytes) -> int:
        """A new transition signature's id in ``t.sig_table``; -1 (reported as a bad line) if it is none."""
        why = _unfit(sig, bad_sig)
        if why is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return -1
        sig_id = self.sig_ids[sig] = len(self.t.sig_table)
        self.t.sig_table.append(sig)
        return sig_id

    def new_guard(self, g: tuple[Any, ...], lineno: int, line: bytes) -> int:
        """A new guard's (key, collectives, tensors) id in ``t.guard_table``; -1 (a bad line) if it is none."""
        why = _unfit(g, bad_guard)
        if why is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return -1
        guard_id = self.guard_ids[g] = len(self.t.guard_table)
        self.t.guard_table.append(g)
        return guard_id

    # ----------------------------------------------------------- machine

    def illegal(self, line: int, rec: dict[str, Any], reason: str, position: int) -> None:
        trigger, state = rec.get("trigger"), rec.get("state")
        self.t.illegal.append(
            Illegal(rank=self.t.rank, position=position, line=line, seq=rec.get("seq"),
                    epoch=plain_int(rec.get("epoch")), trigger=label(trigger) if trigger is not None else None,
                    state=label(state) if state is not None else None, reason=reason)  # fmt: skip
        )

    def check(self, machine: str | None, sig_id: int, sig: tuple[Any, ...]) -> tuple[str | None, str | None]:
        """What the table says of transition ``sig`` from ``machine``: why it is illegal (or None), and where
        the machine goes; kept per (machine, signature)."""
        table = self.table
        assert table is not None  # the fold asks only once trace_opened gave a table
        trigger, source, dest = sig[0], sig[1], sig[2]
        verdict = table.forbids(machine, trigger, source, dest, sig[3])
        legal = table.arrows.get((machine, trigger))
        answer = self.checked[(machine, sig_id)] = (verdict, legal[0] if legal is not None and machine == source
                                                   else dest)  # fmt: skip
        return answer

    def finished_oddly(self, lineno: int, rec: dict[str, Any] | None, line: bytes, state: str | None,
                       pending: str | None, position: int, *, was_open: bool) -> None:  # fmt: skip
        """Note a ``transition_finished`` without a start, or in another state than the machine moves to."""
        rec = rec if rec is not None else orjson.loads(line)
        if not was_open:
            self.illegal(lineno, rec, "transition_finished without transition_started", position)
        if pending is not None and state != pending:
            self.illegal(lineno, rec, f"finished in {state}, but the machine moves to {pending}", position)

    # ------------------------------------------------------- rare records

    def rare(self, event: Any, rec: dict[str, Any], lineno: int, line: bytes, cur_line: int, skipped: int,
             prev_raw: bytes, close: Callable[[bytes, float], None]) -> int:  # fmt: skip
        """A record that is none of the hot ones: ``OUT``, or the ``SKIPPED`` and ``CLOSED`` bits."""
        t = self.t
        if event.__class__ is not str:
            self.bad(lineno, "not a trace record: event is not a name", line)
            return SKIPPED
        if rec.get("run") != self.run0 and event != TRACE_OPENED:
            # Another run's records that keep the seq count going (a restart resets it): read it sorted.
            return OUT
        if event in _KEPT_WHOLE and (why := invalid(rec)) is not None:
            self.bad(lineno, f"not a trace record: {why}", line)
            return SKIPPED
        if event == TRANSITION_FAILED or event == TRANSITION_CANCELLED:
            return self._ended(event, rec, lineno, cur_line, close, len(t.outcome) - 1)
        if event in (GUARD_FAILED, VERIFY_FAILED, STORE_UNREACHABLE):
            t.note(bool(cur_line), lineno, event, rec)
        elif event == RECOVERED:
            self._recovered(rec, lineno, cur_line)
        elif event == TRACE_OPENED:
            return self._opened(rec)
        elif event == TRACE_CLOSED:
            t.closed, self.closed_line, self.closed_skipped = rec, lineno, skipped
            if prev_raw:
                t.note_before_close(orjson.loads(prev_raw))
            if rec.get("clean") is not True:
                t.note(bool(cur_line), lineno, event, rec)
        else:
            return self._own(event, rec, lineno, line, cur_line)
        return 0

    def _ended(self, event: str, rec: dict[str, Any], lineno: int, cur_line: int,
               close: Callable[[bytes, float], None], position: int) -> int:  # fmt: skip
        """A transition failed or cancelled: closed if open, and the machine FAILED after a failure."""
        self.t.note(bool(cur_line), lineno, event, rec)
        if cur_line:
            close(FAILED if event == TRANSITION_FAILED else CANCELLED, float("nan"))
        else:
            self.illegal(lineno, rec, f"{event} without transition_started", position)
        if event == TRANSITION_FAILED:
            self.machine = self.table.failed if self.table is not None else rec.get("state")
        self.pending = None
        return CLOSED if cur_line else 0

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
        """``trace_opened``: the run (another is ``OUT``), and from the first, the meta and the machine's table."""
        t = self.t
        if self.run0 is _NO_RUN:
            self.run0 = rec.get("run")
            if self.want_run is not None and self.run0 != self.want_run:
                return OUT
        elif rec.get("run") != self.run0:
            return OUT
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
                return SKIPPED
            self.t.note(bool(cur_line), lineno, event, rec)
        return 0

    # ------------------------------------------------------- end of file

    def end(self, lineno: int, skipped: int, last_parsed_line: int, last_raw: bytes) -> bool:
        """The file's counts, run, first and last records, and identity damage; False if the last is another run's."""
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
        if self.first_rec is not None or last_rec is not None:
            t.track(self.first_rec or last_rec, 0)
        if last_rec is not None:
            t.track(last_rec, last_parsed_line)
        _identity_damage(t, self.path, self.world0, self.foreign)
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




def _unfit(key: tuple[Any, ...], bad: Callable[[tuple[Any, ...]], str | None]) -> str | None:
    """Why ``key`` cannot be a table's entry: unhashable, or ``bad`` says so."""
    try:
        hash(key)
    except TypeError:
        return "a list or an object where a name belongs"
    return bad(key)
