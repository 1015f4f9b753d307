"""Ranks that stopped (crashed, stuck, unknown) and ranks that straggle.

Wall clocks are used only to say *for how long* a rank has been silent; the
report says they are an estimate. Used by ``miles_fsm.replay.diagnose``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from miles_fsm.replay.evidence import CORE_EVENTS, stopped_from_outside
from miles_fsm.ranks import plural_ranks
from miles_fsm.trace.schema import TRANSITION_CANCELLED, TRANSITION_FINISHED, error_fields
from miles_fsm.replay.model import FINISHED, RankTrace

#: A failed collective's ``transport`` (judged by the writer) -> how it accuses the silent rank.
_TRANSPORT = {"peer_lost": "lost", "timeout": "timeout"}
#: The lifecycle's own errors that accuse the ranks they name as ``missing``.
_ERRORS = {"PeerLostError": "lost", "GuardTimeoutError": "timeout"}


def accusing_kind(transport: str | None, error: str | None) -> str | None:
    """How a recorded failure accuses the ranks it names: ``lost``, ``timeout`` or None (it does not)."""
    return _TRANSPORT.get(transport or "") or _ERRORS.get(error or "")


def cut_off(t: RankTrace) -> bool:
    """The trace ends where the rank was stopped: no ``trace_closed``, or one saying it was stopped from
    outside (its launcher stopped it, or died). Either way the rank did not end its run itself."""
    return t.closed is None or stopped_from_outside(t) is not None


def left_blaming_others(t: RankTrace) -> bool:
    """The rank closed its trace on an error of its own that names other ranks: it left because of them."""
    c = t.closed
    if c is None or c.get("clean") is True:
        return False
    fields = error_fields(c)
    named = set(c.get("culprits") or fields.get("culprits") or ()) | set(fields.get("missing") or ())
    return bool(named - {t.rank})


def cancelled_at(t: RankTrace, position: int | None = None) -> dict | None:
    """The ``transition_cancelled`` record of the rank's last position (or of ``position``), if it was one."""
    at = t.positions - 1 if position is None else position
    return next((n.record for n in reversed(t.notes) if n.event == TRANSITION_CANCELLED and n.position == at), None)


def located(traces: Sequence[RankTrace]) -> list[dict[str, Any]]:
    """Faults that a driver or the demo located itself: records of their own with a ``culprits`` list."""
    out = []
    for t in traces:
        for n in t.notes:
            culprits = n.record.get("culprits")
            if n.event in CORE_EVENTS or not isinstance(culprits, list) or not culprits:
                continue
            out.append(
                {
                    "rank": t.rank,
                    "event": n.event,
                    "position": n.position,
                    "epoch": n.record.get("epoch"),
                    "culprits": sorted(set(culprits)),
                    "error": n.record.get("error"),
                    "where": n.record.get("where"),
                }
            )
    return out


def accusations(
    traces: Sequence[RankTrace],
    guard_failures: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    located: list[dict[str, Any]],
    outside: list[dict[str, Any]],
) -> dict[int, list[dict[str, Any]]]:
    """Who the surviving ranks' records blame for stopping, and how (lost connection, timeout, located)."""
    accused: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for g in guard_failures:
        kind = _ERRORS.get(g["error"] or "")
        if kind is None:
            continue
        via = f"the guard of {g['transition']} (epoch {g['epoch']}, {g['error']})"
        for m in g["missing"]:
            accused[m].append({"kind": kind, "by": g["ranks"], "position": g["position"], "epoch": g["epoch"],
                               "transition": g["transition"], "via": via})
    # A collective that failed on some ranks and left another silent mid-transition: the silent one.
    silent = {t.rank: t.open.index for t in traces if t.open is not None}
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for f in failures:
        kind = _TRANSPORT.get(f["transport"] or "")
        if kind is not None:
            grouped[(f["position"], kind)].append(f)
    for (position, kind), fs in grouped.items():
        f = fs[0]
        by = sorted(x["rank"] for x in fs)
        via = f"the collective of {f['action']} in {f['transition']} (epoch {f['epoch']})"
        for r, at in silent.items():
            if at <= position and r not in by:
                accused[r].append({"kind": kind, "by": by, "position": position, "epoch": f["epoch"],
                                   "transition": f["transition"], "via": via})
    # A failure outside any transition that lost its peer or timed out: the ranks it names, else the cut-off ones.
    cut = [t.rank for t in traces if cut_off(t) and t.state != "FAILED"]
    for f in outside:
        kind = accusing_kind(f["transport"], f["error"])
        if kind is None:
            continue
        via = f"its {f['event']} record" + (f" ({f['where']})" if f["where"] else "")
        for r in f["culprits"] or cut:
            if r != f["rank"]:
                accused[r].append({"kind": kind, "by": [f["rank"]], "position": f["position"], "epoch": f["epoch"],
                                   "transition": f["where"], "via": via})
    for loc in located:
        for c in loc["culprits"]:
            if c != loc["rank"]:
                accused[c].append({"kind": "located", "by": [loc["rank"]], "position": loc["position"],
                                   "epoch": loc["epoch"], "transition": loc["where"],
                                   "via": f"its own {loc['event']} record"})
    # A rank that closed its trace on its own error naming other ranks left because of them: the lost
    # connection its peers then record is its exit, a consequence, never evidence against it.
    by_rank = {t.rank: t for t in traces}
    for r in list(accused):
        t = by_rank.get(r)
        if t is not None and left_blaming_others(t):
            accused[r] = [a for a in accused[r] if a["kind"] != "lost"]
            if not accused[r]:
                del accused[r]
    return accused


def stopped(
    traces: Sequence[RankTrace],
    by_rank: dict[int, RankTrace],
    missing: list[int],
    guard_failures: list[dict[str, Any]],
    accused: dict[int, list[dict[str, Any]]],
    last_wall: float | None,
) -> list[dict[str, Any]]:
    """Ranks that stopped while others needed them: accused by survivors, or ending open or behind."""
    # Ranks waiting at a guard when their trace ends, or failed at one: they wait on someone.
    waiting: dict[int, int] = {}
    for t in traces:
        if t.open is not None and t.open.phase == "guard":
            waiting[t.rank] = t.open.index
    for g in guard_failures:
        if g["error"] in ("GuardTimeoutError", "PeerLostError"):
            for r in g["ranks"]:
                waiting[r] = g["position"]
    wait_pos = max(waiting.values(), default=None)
    # Only accusations that could explain a stop: located faults alone name culprits of other kinds too,
    # unless the rank they name was cut off (its trace has no trace_closed).
    cut = {t.rank for t in traces if cut_off(t)}
    candidates = {r for r, acc in accused.items() if r in cut or any(a["kind"] != "located" for a in acc)}
    open_elsewhere = [t for t in traces if t.open is not None and t.open.phase != "guard"]
    # Every rank stopped at the same point: the job was stopped from outside, nobody is to blame.
    ends = {t.open.index for t in open_elsewhere if t.open is not None}
    everyone = len(open_elsewhere) == len(traces) and len(ends) == 1
    for t in traces:
        if t.open is not None and t.open.phase != "guard" and not everyone:
            candidates.add(t.rank)
        elif wait_pos is not None and t.positions <= wait_pos and t.rank not in waiting and t.state != "FAILED":
            candidates.add(t.rank)
    if waiting:
        candidates.update(missing)
    # The run's own bound on waiting: silence within it is what a live run's slow step looks like.
    bound = max((t.guard_timeout_s for t in traces if t.guard_timeout_s is not None), default=None)
    return [
        _stopped_entry(
            r, by_rank.get(r), accused.get(r, []), sorted(w for w in waiting if w != r), traces, last_wall,
            unread=r not in by_rank and r not in missing, bound=bound,
        )
        for r in sorted(candidates)
    ]


def _stopped_entry(
    r: int,
    t: RankTrace | None,
    acc: list[dict[str, Any]],
    waiters: list[int],
    traces: Sequence[RankTrace],
    last_wall: float | None,
    *,
    unread: bool = False,
    bound: float | None = None,
) -> dict[str, Any]:
    decisive = [a for a in acc if a["kind"] != "located"]
    at = min(decisive or acc, key=lambda a: a["position"]) if acc else None
    since = None if t is None else t.last_wall
    stop = None if t is None else stopped_from_outside(t)
    if stop is not None and not t.after_close:
        since = (t.before_close or {}).get("wall")  # its last record is the stop's: it was last active before
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
        state, epoch, position = t.state, t.epoch, t.positions
        done = t.trigger_at(t.positions - 1) if t.positions else "nothing"
        transition = at["transition"] if at else _next_trigger(traces, t.positions)
        if at is not None and at["epoch"] is not None:
            epoch = at["epoch"]
        inside = f"between transitions: it finished {done}" + (f" and never started {transition}" if transition else "")
        if cancelled_at(t) is not None:
            inside = f"{done}, which it cancelled before its guard: it entered no collective"
        else:
            last_event, last_subject = t.last_event, t.last_subject
            if stop is not None and t.before_close is not None:  # the stop wrote the close: what came before
                last_event, last_subject = t.before_close["event"], t.before_close["subject"]
            if last_event != TRANSITION_FINISHED and last_event is not None:
                # Its last record is outside the lifecycle's transitions (a guarded train step, a driver's own).
                inside = f"between transitions: it finished {done}, and its last record is {last_event}" + (
                    f" of {last_subject}" if last_subject else "")
    if position is None:
        position = at["position"] if at else min((x.positions for x in traces), default=0)
    silent = None if since is None or last_wall is None else max(0.0, last_wall - since)
    how, evidence = _how(r, t, acc)
    finished = any(not cut_off(x) for x in traces if x is not t)
    if how == "unknown" and stop is not None and not acc and (silent is None or bound is None or silent <= bound):
        # Stopped from outside before anyone recorded a timeout or a lost connection naming it, and silent no
        # longer than a guard may wait: this is where the stop found it, not evidence that it hung.
        how = "stopped"
        evidence = (f"{_stop_cause(stop)} while it was here, {'after an unknown time' if silent is None else f'~{silent:.1f} s'}"
                    " after its previous record; no rank had recorded a timeout or a lost connection naming it, so "
                    "nothing singles it out")
    elif how == "unknown" and t is not None and t.closed is None and not acc and not finished and (
            silent is None or bound is None or silent <= bound):  # fmt: skip
        # Nobody recorded a timeout or a lost connection, no rank has finished, and it has been silent no
        # longer than a guard may wait: a live run replayed mid-flight looks exactly like this. Not stuck,
        # not anyone's fault yet.
        how = "silent"
        limit = "the guard timeout" if bound is None else f"the guard timeout ({bound:g} s)"
        evidence = (f"silent for {'an unknown time' if silent is None else f'~{silent:.1f} s'}, no longer than "
                    f"{limit}, and no rank recorded a timeout or a lost connection naming it: the run may still be "
                    "running, or was stopped from outside; replay it again later, or check the process")
    verb = {"crashed": "crashed", "stuck": "is stuck", "unknown": "stopped", "left": "left the run",
            "cancelled": "cancelled", "silent": "is silent", "stopped": "was stopped from outside"}[how]
    if t is None:
        summary = f"rank {r} {verb}: " + ("its trace was not read (--rank)" if unread else "it left no trace")
    elif how == "cancelled":
        summary = f"rank {r} cancelled {transition} before its guard (epoch {epoch}, state {state}): it entered no collective"
    elif t.open is not None:
        summary = f"rank {r} {verb} in {inside} (epoch {epoch}, state {state})"
    else:
        summary = f"rank {r} {verb} in {state}, {inside} (epoch {epoch})"
    if silent is not None and silent >= 0.1:
        summary += f"; silent for ~{silent:.1f} s before the last record of any rank"
    accusers = sorted({x for a in decisive for x in a["by"]})
    if accusers:
        summary += f"; {plural_ranks(accusers)} " + (
            "lost their connection to it" if any(a["kind"] == "lost" for a in decisive) else "timed out waiting for it"
        )
    elif waiters:
        summary += f"; {plural_ranks(waiters)} were waiting for it at a guard"
    return {
        "rank": r,
        "state": state,
        "epoch": epoch,
        "transition": transition,
        "position": position,
        "inside": inside,
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


def _how(r: int, t: RankTrace | None, acc: list[dict[str, Any]]) -> tuple[str, str]:
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
    if t is not None and not cut_off(t) and waited:
        # A rank that closed its trace did not crash: it left the lifecycle itself, on its own error or done.
        c = t.closed
        own = "" if c.get("clean") is True else \
            f" on its own error, {c.get('error') or 'an error'}: {_first_line(c.get('message'))}"  # fmt: skip
        return "left", (
            f"rank {r} closed its trace{own or ' cleanly'} and left while {plural_ranks(waited)} still needed it "
            f"({'they lost their connection to it' if lost else 'they timed out waiting for it'}): it did not "
            f"crash{also}"
        )
    if lost and kinds["lost"] >= kinds["timeout"]:
        a = lost[0]
        return "crashed", (
            f"{plural_ranks(sorted({x for a in lost for x in a['by']}))} lost their connection to rank {r} in "
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


def _next_trigger(traces: Sequence[RankTrace], index: int) -> str | None:
    for t in traces:
        if t.positions > index:
            return t.trigger_at(index)
    return None


# -------------------------------------------------------------- stragglers


def stragglers(traces: Sequence[RankTrace], ratio: float, floor_s: float) -> list[dict[str, Any]]:
    """Per trigger: the rank with the most own work time (guard wait excluded) against the median."""
    import numpy as np

    traces = [t for t in traces if t.positions]
    if len(traces) < 2:
        return []
    width = max(t.positions for t in traces)
    work = np.full((len(traces), width), np.nan)
    for i, t in enumerate(traces):
        row = np.frombuffer(t.work_s, dtype=np.float64)
        ok = np.frombuffer(bytes(t.outcome), dtype=np.uint8) == FINISHED[0]
        work[i, : t.positions] = np.where(ok, row, np.nan)
    ref = max(traces, key=lambda t: t.positions)
    triggers = np.array([ref.trigger_at(j) for j in range(ref.positions)], dtype=object)
    ranks = np.array([t.rank for t in traces])
    out = []
    for trig in dict.fromkeys(triggers.tolist()):
        cols = np.nonzero(triggers == trig)[0]
        sub = work[:, cols]
        counted = ~np.isnan(sub)
        if not counted.any():
            continue
        totals = np.where(counted, sub, 0.0).sum(axis=1)
        has = counted.any(axis=1)
        med = float(np.median(totals[has]))
        slow = int(np.argmax(np.where(has, totals, -np.inf)))
        entry: dict[str, Any] = {
            "transition": trig,
            "instances": int(len(cols)),
            "slowest_rank": int(ranks[slow]),
            "slowest_s": float(totals[slow]),
            "median_s": med,
            "ratio": float(totals[slow] / med) if med > 0 else None,
        }
        live = counted.any(axis=0)  # columns some rank finished (nanmedian warns on the others)
        cols, sub, counted = cols[live], sub[:, live], counted[:, live]
        col_med = np.nanmedian(sub, axis=0)
        col_max = np.max(np.where(counted, sub, -np.inf), axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            col_ratio = np.where(col_med > 0, col_max / col_med, np.nan)
        if not np.all(np.isnan(col_ratio)):
            k = int(np.nanargmax(col_ratio))
            who = int(np.argmax(np.where(counted[:, k], sub[:, k], -np.inf)))
            entry["worst"] = {
                "epoch": int(ref.epochs[cols[k]]),
                "rank": int(ranks[who]),
                "seconds": float(col_max[k]),
                "median_s": float(col_med[k]),
                "ratio": float(col_ratio[k]),
            }
        entry["straggler"] = bool(
            entry["ratio"] is not None and entry["ratio"] >= ratio and totals[slow] - med >= floor_s
        )
        out.append(entry)
    return out


