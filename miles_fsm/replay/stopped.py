"""One stopped rank described: where it was, how it stopped, on what evidence.

``miles_fsm.replay.stalls`` finds the ranks that stopped while others needed
them; ``stopped_entry`` describes each. Wall clocks only say *for how long* a
rank was silent, an estimate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from miles_fsm.ranks import plural_ranks
from miles_fsm.replay.evidence import SIGNALLED, last_own_record, stopped_from_outside
from miles_fsm.replay.model import RankTrace
from miles_fsm.replay.shapes import Accusation, StopHow, StoppedRank
from miles_fsm.trace.schema import TRACE_CLOSED, TRANSITION_CANCELLED, TRANSITION_FINISHED, error_fields

__all__ = ["cancelled_at", "cut_off", "stopped_entry"]


def cut_off(t: RankTrace) -> bool:
    """The trace ends where the rank was stopped: no ``trace_closed``, or one saying it was stopped from
    outside (its launcher stopped it, or died). Either way the rank did not end its run itself."""
    return t.closed is None or stopped_from_outside(t) is not None


def cancelled_at(t: RankTrace, position: int | None = None) -> dict[str, Any] | None:
    """The ``transition_cancelled`` record of the rank's last position (or of ``position``), if it was one."""
    at = t.positions - 1 if position is None else position
    return next((n.record for n in reversed(t.notes) if n.event == TRANSITION_CANCELLED and n.position == at), None)


def stopped_entry(
    r: int,
    t: RankTrace | None,
    acc: list[Accusation],
    waiters: list[int],
    traces: Sequence[RankTrace],
    last_wall: float | None,
    *,
    unread: bool = False,
    bound: float | None = None,
) -> StoppedRank:
    """Rank ``r``, stopped: where it was, how it stopped and on what evidence, and a one-line summary.

    ``acc``: the accusations naming it; ``waiters``: the ranks waiting for it at a guard;
    ``last_wall``: the last record's wall time of any rank; ``bound``: the run's guard timeout.
    """
    decisive = [a for a in acc if a["kind"] != "located"]
    at = min(decisive or acc, key=lambda a: a["position"]) if acc else None
    since = None if t is None else last_own_record(t)[2]
    stop = None if t is None else stopped_from_outside(t)
    where = _where(t, at, traces, unread=unread)
    silent = None if since is None or last_wall is None else max(0.0, last_wall - since)
    how, evidence = _judged(r, t, acc, traces, stop, silent, bound)
    accusers = sorted({x for a in decisive for x in a["by"]})
    if how == "silent":
        summary = _live(r, where, silent, bound, waiters, opened=t is not None and t.open is not None)
    else:
        summary = _summary(r, t, how, where, unread=unread)
        if silent is not None and silent >= 0.1:
            summary += f"; silent for ~{silent:.1f} s before the last record of any rank"
        if accusers:
            lost = any(a["kind"] == "lost" for a in decisive)
            summary += "; " + (plural_ranks(accusers, ("lost its", "lost their")) + " connection to it" if lost
                               else plural_ranks(accusers) + " timed out waiting for it")  # fmt: skip
        elif waiters:
            summary += f"; {plural_ranks(waiters, ('was', 'were'))} waiting for it at a guard"
    return {
        "rank": r,
        "state": where.state,
        "epoch": where.epoch,
        "transition": where.transition,
        "position": where.position,
        "inside": where.inside,
        "silent_s": silent,
        "silent_basis": "wall clocks of different ranks (an estimate)",
        "how": how,
        "closed": None if t is None or t.closed is None else ("clean" if t.closed.get("clean") is True else "unclean"),
        "evidence": evidence,
        "accused_by": accusers,
        "located_by": sorted({x for a in acc if a["kind"] == "located" for x in a["by"]}),
        "waited_on_by": waiters,
        "summary": summary,
    }


class _Where(NamedTuple):
    """Where a stopped rank was: its state, epoch, position, transition, and a phrase for inside what."""

    state: str | None
    epoch: int | None
    position: int
    transition: str | None
    inside: str


_VERB = {"crashed": "crashed", "stuck": "is stuck", "unknown": "stopped", "left": "left the run",
         "cancelled": "cancelled", "silent": "is silent", "stopped": "was stopped from outside"}  # fmt: skip


def _summary(r: int, t: RankTrace | None, how: StopHow, w: _Where, *, unread: bool) -> str:
    """The first words of a stopped rank's summary: who, how, and where."""
    if t is None:
        return f"rank {r} {_VERB[how]}: " + ("its trace was not read (--rank)" if unread else "it left no trace")
    if how == "cancelled":
        return f"rank {r} cancelled {w.transition} before its guard (epoch {w.epoch}, state {w.state}): it entered no collective"
    # A rank that closed its trace on a signal sent to it alone left the run, but not of its own accord.
    closed = t.closed or {}
    verb = _VERB[how]
    if how == "left" and closed.get("error") == SIGNALLED:
        verb = f"was stopped by {error_fields(closed).get('signal') or 'a signal'} sent to its process alone"
    if t.open is not None:
        return f"rank {r} {verb} in {w.inside} (epoch {w.epoch}, state {w.state})"
    return f"rank {r} {verb} in {w.state}, {w.inside}"


def _live(r: int, w: _Where, silent: float | None, bound: float | None, waiters: list[int], *, opened: bool) -> str:
    """A silent rank's summary: a live run's, which singles nobody out (nothing has failed yet)."""
    since = "" if silent is None or silent < 0.1 else f", ~{silent:.1f} s before the latest record of any rank"
    limit = "the guard timeout" if bound is None else f"the guard timeout ({bound:g} s)"
    who = f"{plural_ranks(waiters, ('is', 'are'))} waiting at a guard for rank {r}, last seen" if waiters \
        else f"rank {r} was last seen"  # fmt: skip
    return (f"no rank has failed yet, and the run may still be running: {who} in {w.state}, {w.inside}"
            + (f" (epoch {w.epoch})" if opened else "") + f"{since}, within {limit}")


def _where(t: RankTrace | None, at: Accusation | None, traces: Sequence[RankTrace], *, unread: bool) -> _Where:
    """Where the rank stopped: its state, epoch, position, transition, and a phrase for inside what."""
    if t is None:
        state, epoch, position, transition = None, at["epoch"] if at else None, None, None
        inside = "its trace was not read (left out by --rank)" if unread else "no trace at all"
    elif t.open is not None:
        o = t.open
        state, epoch, position, transition = o.source, o.epoch, o.index, o.trigger
        inside = {
            "planning": f"{o.trigger}, before its guard",
            "guard": f"the guard of {o.trigger}",
            "step": f"action {o.action} of {o.trigger}",
            "between steps": f"{o.trigger}, after its action {o.action}",
        }[o.phase]
    else:
        state, position = t.state, t.positions
        # The transition it never started, with its epoch: the one its peers waited in, else a peer's next.
        transition, epoch = _next_trigger(traces, t.positions)
        if at is not None:
            transition, epoch = at["transition"], at["epoch"] if at["epoch"] is not None else epoch
        epoch = t.epoch if epoch is None else epoch
        inside = _between(t, transition, epoch)
    if position is None:
        position = at["position"] if at else min((x.positions for x in traces), default=0)
    return _Where(state, epoch, position, transition, inside)


def _between(t: RankTrace, transition: str | None, epoch: int | None) -> str:
    """Where a rank stopped between transitions: after which one (and its epoch), before which, and its last
    record if that is outside them. Each transition named with its own epoch, never another's."""
    done = "nothing" if not t.positions else f"{t.trigger_at(t.positions - 1)} (epoch {t.epochs[t.positions - 1]})"
    if cancelled_at(t) is not None:
        return f"between transitions: it cancelled {done} before its guard, and entered no collective"
    at = "" if epoch is None else f" (epoch {epoch})"
    if transition is None:
        inside = f"between transitions: it finished {done}"
    elif any(sig[0] == transition for sig in t.sig_table):
        inside = f"between transitions: it finished {done} and never started {transition}{at}"
    else:  # not a transition: the driver's or the demo's own step (a guarded train step), where its peers waited
        inside = f"between transitions: it finished {done}, and its peers then waited for it in {transition}{at}"
    last_event, last_subject, _ = last_own_record(t)
    if last_event not in (TRANSITION_FINISHED, TRACE_CLOSED, None):
        # Its last record is outside the lifecycle's transitions (a guarded train step, a driver's own).
        inside += f"; its last record is {last_event}" + (f" of {last_subject}" if last_subject else "")
    return inside


def _judged(r: int, t: RankTrace | None, acc: list[Accusation], traces: Sequence[RankTrace],
            stop: dict[str, Any] | None, silent: float | None, bound: float | None) -> tuple[StopHow, str]:  # fmt: skip
    """How the rank stopped, and the evidence: ``_how``, unless nothing recorded tells a stop or a hang apart."""
    how, evidence = _how(r, t, acc)
    if how != "unknown" or acc or not (silent is None or bound is None or silent <= bound):
        return how, evidence
    if stop is not None:
        # Stopped from outside before anyone recorded a timeout or a lost connection naming it, and silent no
        # longer than a guard may wait: this is where the stop found it, not evidence that it hung.
        return "stopped", (
            f"{_stop_cause(stop)} while it was here, {'after an unknown time' if silent is None else f'~{silent:.1f} s'}"
            " after its previous record; no rank had recorded a timeout or a lost connection naming it, so "
            "nothing singles it out")
    finished = any(not cut_off(x) for x in traces if x is not t)
    if t is not None and t.closed is None and not finished:
        # Nobody recorded a timeout or a lost connection, no rank has finished, and it has been silent no
        # longer than a guard may wait: a live run replayed mid-flight looks exactly like this. Not stuck,
        # not anyone's fault yet.
        limit = "the guard timeout" if bound is None else f"the guard timeout ({bound:g} s)"
        return "silent", (
            f"silent for {'an unknown time' if silent is None else f'~{silent:.1f} s'}, no longer than "
            f"{limit}, and no rank recorded a timeout or a lost connection naming it: the run may still be "
            "running, or was stopped from outside; replay it again later, or check the process")
    return how, evidence


def _stop_cause(closed: dict[str, Any]) -> str:
    """Who stopped a rank from outside, and why, from its ``trace_closed``'s error fields."""
    if closed.get("error") == "LauncherLostError":
        return "its launcher died and the rank stopped"
    fields = error_fields(closed)
    reason = fields.get("reason")
    if reason == "signal":
        return f"its launcher got {fields.get('signal') or 'a signal'} (an operator's or a scheduler's stop) and stopped it"
    if reason == "timeout":
        return "its launcher stopped it at the run's time limit"
    if reason == "peer_failed":
        return f"its launcher stopped it after {plural_ranks(sorted(fields.get('failed') or ()))} failed"
    return "its launcher stopped it"


def _how(r: int, t: RankTrace | None, acc: list[Accusation]) -> tuple[StopHow, str]:
    kinds = Counter(a["kind"] for a in acc)
    lost = [a for a in acc if a["kind"] == "lost"]
    timeout = [a for a in acc if a["kind"] == "timeout"]
    located = sorted({x for a in acc if a["kind"] == "located" for x in a["by"]})
    also = f"; {plural_ranks(located)} also named it as the culprit" if located else ""
    waited = sorted({x for a in lost + timeout for x in a["by"]})
    cancel = None if t is None else cancelled_at(t)
    if cancel is not None and waited:
        # The one abandoned transition that is no divergence: this rank entered no collective, the others
        # then fail their guard waiting for it.
        return "cancelled", (
            f"rank {r} cancelled {cancel.get('trigger')} (epoch {cancel.get('epoch')}) before its guard "
            f"({cancel.get('error') or 'a cancellation'}), so it entered no collective; {plural_ranks(waited)} "
            f"then failed at the guard waiting for it{also}"
        )
    if t is not None and (c := t.closed) is not None and not cut_off(t) and waited:
        # A rank that closed its trace did not crash: it left the lifecycle itself, on its own error or done.
        own = "" if c.get("clean") is True else \
            f" on its own error, {c.get('error') or 'an error'}: {_first_line(c.get('message'))}"  # fmt: skip
        return "left", (
            f"rank {r} closed its trace{own or ' cleanly'} and left while {plural_ranks(waited)} still needed it "
            f"({plural_ranks(waited, ('lost its', 'lost their')) + ' connection to it' if lost else plural_ranks(waited) + ' timed out waiting for it'}): it did not "
            f"crash{also}"
        )
    if lost and kinds["lost"] >= kinds["timeout"]:
        a = lost[0]
        return "crashed", (
            f"{plural_ranks(sorted({x for a in lost for x in a['by']}), ('lost its', 'lost their'))} connection to rank {r} in "
            f"{a['via']} and recorded it, while rank {r} recorded nothing more: its process was gone{also}"
        )
    if timeout:
        a = timeout[0]
        return "stuck", (
            f"{plural_ranks(sorted({x for a in timeout for x in a['by']}))} waited the full timeout for rank {r} in "
            f"{a['via']}: its process was alive (its connections stayed open) but it never arrived{also}"
        )
    if t is not None and t.truncated is not None:
        return "crashed", f"its last line ({t.truncated.where}) is cut short: the process died while writing it{also}"
    if t is None:
        return "unknown", f"its trace is not here; whether it crashed, hung or never started is not in the records{also}"
    return "unknown", (
        "no surviving rank recorded a timeout or a lost connection naming it, so the traces cannot tell "
        f"whether it crashed or hung; check its exit status, or py-spy dump it if it is still alive{also}"
    )


def _first_line(text: Any) -> str:
    return str(text).splitlines()[0] if text else ""


def _next_trigger(traces: Sequence[RankTrace], index: int) -> tuple[str | None, int | None]:
    """The transition some rank started at position ``index``, and its epoch (None, None: no rank did)."""
    for t in traces:
        if t.positions > index:
            return t.trigger_at(index), t.epochs[index]
    return None, None
