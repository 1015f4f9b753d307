"""The fold's transitions: a start, its guard, its end, re-driven through the machine's table.

Part of ``FoldState`` (``miles_fsm.replay.fold_state``): each method runs
once per transition or guard record, called by the fold's loop, and keeps
the loop's own locals few. A transition is legal when the table has its
arrow out of the state the machine is in; its records are held to it by
``miles_fsm.replay.consistency``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import orjson

from miles_fsm.replay.checks import I64, label, plain_int
from miles_fsm.replay.consistency import STEP, TRIGGER, Consistency
from miles_fsm.replay.hot import UNSET
from miles_fsm.replay.model import FINISHED, Illegal
from miles_fsm.trace.schema import GUARD_ENTERED, GUARD_PASSED

__all__ = ["Moves", "known_id"]


class Moves(Consistency):
    """``FoldState``'s transitions and guards (its attributes are ``FoldState``'s)."""

    __slots__ = ("step_guard",)
    sig_ids: dict[tuple[Any, ...], int]
    guard_ids: dict[tuple[Any, ...], int]
    checked: dict[tuple[str | None, int], str | None]
    _columns: tuple[Any, ...]
    #: A guard outside any transition (a step's, ``agree_on``) was entered, and not passed or failed.
    step_guard: bool

    bad: Callable[[int, str, bytes], None]
    new_sig: Callable[[tuple[Any, ...], int, bytes], int]
    new_guard: Callable[[tuple[Any, ...], int, bytes], int]

    def started(self, h: Any, rec: dict[str, Any] | None, lineno: int, line: bytes, machine: str | None,
                committed: int | None, opened: tuple[Any, ...]) -> tuple[Any, ...] | None:  # fmt: skip
        """``transition_started``: the fold's new (line, epoch, sig id, (epoch, state, trigger), steps, first step,
        machine, pending state); None if the record is no transition (a bad line)."""
        sig = (h.trigger, h.state, h.dest, tuple(planned) if (planned := h.steps).__class__ is list else None)
        sig_id = self.sig_ids.get(sig, -1) if rec is None else known_id(self.sig_ids, sig)  # a HotRecord's hashes
        if sig_id < 0 and (sig_id := self.new_sig(sig, lineno, line)) < 0:
            return None
        epoch = h.epoch
        if opened[0] or (committed is not None and epoch != committed and epoch != committed + 1):
            self.odd_start(lineno, epoch, committed, opened)
        epoch = epoch if epoch.__class__ is int and -I64 <= epoch < I64 else -1
        machine = sig[1] if machine is None else machine
        pending = sig[2] if self.table is None else (
            self.checked.get((machine, sig_id)) or self.moves(machine, sig_id, sig, lineno, rec, line))  # fmt: skip
        return lineno, epoch, sig_id, (epoch, sig[1], sig[0]), sig[3], sig[3][0] if sig[3] else None, machine, pending

    def guard(self, event: str, h: Any, rec: dict[str, Any] | None, lineno: int, line: bytes, cur: Any,
              now: tuple[Any, ...], where: tuple[Any, ...]) -> tuple[int, str, float] | None:  # fmt: skip
        """A guard record: the open transition's (guard id, phase, guard wait) after it; None if it is bad."""
        g, phase, wait, step_i, act_open = now
        if cur is None:  # a step outside the lifecycle (``agree_on``): the machine's state, the rank's epoch
            self.outside(lineno, event, (h.epoch, h.state, h.trigger, True), where)
            if (h.key.__class__ is not int or h.collectives is UNSET or h.tensors is UNSET if event == GUARD_ENTERED
                    else h.duration_s is UNSET):  # fmt: skip
                self.bad(lineno, f"not a trace record: a {event} without a field the schema gives it", line)
                return None
            if h.trigger.__class__ is not str:
                self.count(TRIGGER, lineno, f"{event} outside any transition names no step")
            if self.step_guard == (event == GUARD_ENTERED):  # entered twice, or passed without entering
                self.count(STEP, lineno, f"{event} of {h.trigger}, outside any transition, out of its guard's order")
            self.step_guard = event == GUARD_ENTERED
            return g, phase, wait
        steps_ok = phase == "guard" if event == GUARD_PASSED else g < 0 and not step_i and act_open is None
        if (h.epoch, h.state, h.trigger) != cur or not steps_ok or (
                event == GUARD_PASSED and h.duration_s is UNSET):  # fmt: skip
            self.odd(lineno, h, cur, (), None, act_open)
            if not steps_ok:
                self.count(STEP, lineno, f"{event} in {cur[2]} after its {phase} (a guard comes once, before steps)")
        if event == GUARD_PASSED:
            return g, "between steps", (d if (d := h.duration_s).__class__ is float else 0.0)
        if h.key.__class__ is not int or h.collectives is UNSET or h.tensors is UNSET:
            self.bad(lineno, "not a trace record: a guard without a 64-bit key, its collectives or its tensors", line)
            return None
        guard_key = (h.key, tuple(cols) if (cols := h.collectives).__class__ is list else (), h.tensors)
        guard_id = self.guard_ids.get(guard_key, -1) if rec is None else known_id(self.guard_ids, guard_key)
        if guard_id < 0 and (guard_id := self.new_guard(guard_key, lineno, line)) < 0:
            return None
        return guard_id, "guard", wait

    def illegal(self, line: int, rec: dict[str, Any], reason: str, position: int) -> None:
        trigger, state = rec.get("trigger"), rec.get("state")
        self.t.illegal.append(
            Illegal(rank=self.t.rank, position=position, line=line, seq=rec.get("seq"),
                    epoch=plain_int(rec.get("epoch")), trigger=label(trigger) if trigger is not None else None,
                    state=label(state) if state is not None else None, reason=reason)  # fmt: skip
        )

    def moves(self, machine: str | None, sig_id: int, sig: tuple[Any, ...], lineno: int, rec: dict[str, Any] | None,
              line: bytes) -> str | None:  # fmt: skip
        """Where transition ``sig`` takes the machine from ``machine``, as the table says; an illegal one is noted.
        A legal one is kept per (machine, signature), for the fold to find without a call."""
        table = self.table
        assert table is not None  # the fold asks only once trace_opened gave a table
        trigger, source, dest = sig[0], sig[1], sig[2]
        verdict = table.forbids(machine, trigger, source, dest, sig[3])
        arrow: tuple[Any, Any] = (machine, trigger)  # any JSON the record holds: no arrow, unless the table has it
        legal = table.arrows.get(arrow)
        goes = legal[0] if legal is not None and machine == source else dest
        if verdict is None:
            self.checked[(machine, sig_id)] = goes
        else:
            self.illegal(lineno, rec if rec is not None else orjson.loads(line), verdict, len(self.t.outcome))
        return goes

    def finished(self, lineno: int, rec: dict[str, Any] | None, line: bytes, h: Any, pending: str | None,
                 opened: tuple[int, float, int, int, int], at: tuple[Any, ...]) -> bool:  # fmt: skip
        """``transition_finished``: the open transition closed; one without a start, or in another state than the
        machine moves to, is illegal; one whose records or steps are not its own is damage. True if the line is
        bad (skipped)."""
        state, duration = h.state, h.duration_s
        cur_line, wait_s, epoch, sig, guard = opened
        if state is not None and state.__class__ is not str:
            self.bad(lineno, "not a trace record: state is not a name", line)
            return True
        if cur_line:  # ``close``, inline: once per transition, a call fewer
            epochs, sigs, guards, work_s, outcome = self._columns
            epochs(epoch)
            sigs(sig)
            guards(guard if guard >= 0 else 0)
            work_s(duration - wait_s if duration.__class__ is float else math.nan)
            outcome(FINISHED)
            cur, steps, step_i, act_open, phase = at
            if (h.epoch, h.source, h.trigger) != cur or act_open is not None or step_i != len(steps) or (
                    duration is UNSET or phase == "guard"):  # fmt: skip
                self.odd(lineno, h, cur, steps, steps[step_i] if step_i < len(steps) else None, act_open)
                if phase == "guard":
                    self.count(STEP, lineno, f"{cur[2]} finished, but its guard never passed")
        if not cur_line or (pending is not None and state != pending):
            position, rec = len(self.t.outcome) - 1, rec if rec is not None else orjson.loads(line)
            if not cur_line:
                self.illegal(lineno, rec, "transition_finished without transition_started", position)
            if pending is not None and state != pending:
                self.illegal(lineno, rec, f"finished in {state}, but the machine moves to {pending}", position)
        return False


def known_id(ids: dict[tuple[Any, ...], int], key: tuple[Any, ...]) -> int:
    """``key``'s id in ``ids``, else -1: a line orjson read may hold a list where a name belongs."""
    try:
        return ids.get(key, -1)
    except TypeError:  # unhashable: reported as a bad line by ``new_sig`` or ``new_guard``
        return -1
