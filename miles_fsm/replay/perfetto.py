"""Chrome trace (Perfetto) export of per-rank traces.

One process per rank (``pid`` = rank) with two tracks: the lifecycle state
the rank is in, and its transitions with their guard and actions nested
inside. Each ``memory_snapshot`` is drawn on counter tracks of the rank
(``device``, ``host`` and ``rss memory (MiB)``, a series per tag). Guard failures,
verification failures and recoveries are instant events; a flow arrow links the ranks that entered the same guard, in arrival
order, so a late or missing rank shows at a glance.

Records are drawn in ``seq`` order and only those of the run replay read;
a record whose fields are not what the schema says is left out, as the
reader reports it (``miles_fsm.replay.checks``).

Timestamps: each rank's own monotonic clock, offset by its first wall time,
so slices within a rank are exact and ranks line up as well as their wall
clocks agree. Slices are written as B/E pairs and always properly nested:
a record that would break the nesting closes what it must, and whatever is
still open when a trace ends is closed there and marked ``unfinished``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.replay.checks import invalid, label
from miles_fsm.replay.model import EpochRange, RankTrace
from miles_fsm.replay.order import records
from miles_fsm.replay.outputs import OutputPathError, check_output, written
from miles_fsm.trace.schema import (
    ACTION_FINISHED,
    ACTION_STARTED,
    GUARD_ENTERED,
    GUARD_FAILED,
    GUARD_PASSED,
    MEMORY_SNAPSHOT,
    RECOVERED,
    TRACE_OPENED,
    TRANSITION_CANCELLED,
    TRANSITION_FAILED,
    TRANSITION_FINISHED,
    TRANSITION_STARTED,
    VERIFIED,
    VERIFY_FAILED,
    error_fields,
)

__all__ = ["STATE_TID", "TRANSITION_TID", "OutputPathError", "check_output", "export_perfetto"]


STATE_TID = 1
TRANSITION_TID = 2
COLLECTIVE_TID = 3


class _Track:
    """B/E slices on one thread, kept properly nested and in time order."""

    __slots__ = ("pid", "tid", "stack", "last_ts", "emit")

    def __init__(self, pid: int, tid: int, emit: Any) -> None:
        self.pid = pid
        self.tid = tid
        self.stack: list[str] = []
        self.last_ts = float("-inf")
        self.emit = emit

    def _ts(self, ts: float) -> float:
        self.last_ts = max(self.last_ts, ts)
        return self.last_ts

    def begin(self, name: str, ts: float, cat: str, args: dict[str, Any] | None = None) -> None:
        ev = {"name": name, "cat": cat, "ph": "B", "ts": self._ts(ts), "pid": self.pid, "tid": self.tid}
        if args:
            ev["args"] = args
        self.stack.append(name)
        self.emit(ev)

    def end(self, name: str, ts: float, args: dict[str, Any] | None = None) -> bool:
        """Close ``name`` and anything opened inside it; False if it is not open."""
        if name not in self.stack:
            return False
        while self.stack:
            top = self.stack.pop()
            ev = {"name": top, "ph": "E", "ts": self._ts(ts), "pid": self.pid, "tid": self.tid}
            if top == name:
                if args:
                    ev["args"] = args
                self.emit(ev)
                return True
            ev["args"] = {"unfinished": True}
            self.emit(ev)
        return True  # pragma: no cover - name was in the stack

    def close_all(self, ts: float) -> None:
        while self.stack:
            self.end(self.stack[-1], ts, {"unfinished": True})

    def instant(self, name: str, ts: float, cat: str, args: dict[str, Any]) -> None:
        self.emit({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self._ts(ts), "pid": self.pid,
                   "tid": self.tid, "args": args})


def export_perfetto(
    traces: Sequence[RankTrace],
    out: str | os.PathLike[str],
    *,
    epochs: EpochRange | None = None,
    collectives: Sequence[Mapping[str, Any]] = (),
) -> int:
    """Write a Chrome/Perfetto JSON trace of the given ranks; returns the number of events.

    ``collectives``: each rank's in-flight collective from its Flight Recorder
    dump (``FrReport.to_json()["ranks"]``), drawn on a track of its own from
    its creation to the end of the timeline.
    """
    walls = [t.first_wall for t in traces if t.first_wall is not None]
    # Dumps alone (no traces): the timeline starts at the first collective.
    base = min(walls) if walls else min((c["time_ns"] / 1e9 for c in collectives), default=0.0)
    guards: dict[tuple[Any, ...], list[tuple[float, int]]] = defaultdict(list)
    count = 0
    end_ts = 0.0
    # Written beside ``out`` and renamed over it once whole (``outputs.written``): a write error is one
    # ``OutputPathError``, and leaves no half timeline behind.
    with written(out) as f:
        f.write(b'{"displayTimeUnit":"ms","traceEvents":[\n')
        first = True

        def emit(ev: dict[str, Any]) -> None:
            nonlocal first, count, end_ts
            end_ts = max(end_ts, ev.get("ts", 0.0))
            if not first:
                f.write(b",\n")
            try:
                f.write(orjson.dumps(ev))
            except orjson.JSONEncodeError as exc:  # a value orjson cannot write: the event stays, its args go
                f.write(orjson.dumps({**ev, "args": {"not_shown": str(exc)}}))
            first = False
            count += 1

        for t in traces:
            _export_rank(t, base, epochs, emit, guards)
        flow_id = 0
        for (epoch, trigger, _k), points in guards.items():
            if len(points) < 2:
                continue
            flow_id += 1
            points.sort()
            for i, (ts, rank) in enumerate(points):
                ph = "s" if i == 0 else ("f" if i == len(points) - 1 else "t")
                ev = {"name": f"guard {trigger} e{epoch}", "cat": "guard", "ph": ph, "id": flow_id, "ts": ts,
                      "pid": rank, "tid": TRANSITION_TID}
                if ph != "s":
                    ev["bp"] = "e"
                emit(ev)
        for rank in sorted({c["rank"] for c in collectives} - {t.rank for t in traces}):
            emit({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (no trace)"}})
        end_ts = max([end_ts, *((c["time_ns"] / 1e9 - base) * 1e6 for c in collectives)])
        for c in collectives:
            _export_collective(c, base, end_ts, emit)
        f.write(b"\n],")
        ranks = sorted({t.rank for t in traces} | {c["rank"] for c in collectives})
        f.write(b'"otherData":' + orjson.dumps({"generator": "miles-fsm replay", "ranks": ranks}))
        f.write(b"}\n")
    return count


def _export_collective(c: Mapping[str, Any], base: float, end_ts: float, emit: Any) -> None:
    """One rank's in-flight collective, from its creation (wall clock, as the recorder keeps it) on."""
    ts = (c["time_ns"] / 1e9 - base) * 1e6
    pid = c["rank"]
    emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": COLLECTIVE_TID,
          "args": {"name": "in-flight collective (flight recorder)"}})  # fmt: skip
    emit({"name": f"{c['op']} #{c['collective_seq_id']} ({c['process_group']})", "cat": "collective", "ph": "X",
          "ts": ts, "dur": max(end_ts - ts, 1.0), "pid": pid, "tid": COLLECTIVE_TID,
          "args": {k: c.get(k) for k in ("where", "epoch", "declared", "input_sizes", "output_sizes")}})  # fmt: skip


def _export_rank(
    t: RankTrace,
    base: float,
    epochs: EpochRange | None,
    emit: Any,
    guards: dict[tuple[Any, ...], list[tuple[float, int]]],
) -> None:
    pid = t.rank
    host = t.meta.get("host")
    title = f"rank {t.rank}" + (f" ({host})" if host else "")
    for meta in _rank_metadata(pid, title, t.rank):
        emit(meta)
    states = _Track(pid, STATE_TID, emit)
    tx = _Track(pid, TRANSITION_TID, emit)
    wall0 = t.first_wall if t.first_wall is not None else base
    mono0 = t.first_mono_ns
    offset_us = (wall0 - base) * 1e6
    seen: dict[tuple[Any, Any], int] = defaultdict(int)

    def entered_guard(epoch: Any, trigger: Any) -> None:  # the n-th guard of (epoch, trigger), lined up across ranks
        seen[epoch, trigger] += 1
        guards[(epoch, trigger, seen[epoch, trigger])].append((tx.last_ts, pid))

    last_ts = 0.0
    for rec in records(Path(t.path), run=t.run, ordered=not t.out_of_order and len(t.runs) <= 1
                       and not t.duplicates):  # fmt: skip
        if invalid(rec) is not None:
            continue  # the analysis reports it as a bad line
        epoch = rec.get("epoch")
        if epochs is not None and epoch not in epochs:
            continue
        mono = rec.get("mono_ns")
        if isinstance(mono, int) and mono0 is not None:
            ts = offset_us + (mono - mono0) / 1e3
        elif isinstance(rec.get("wall"), (int, float)):
            ts = (rec["wall"] - base) * 1e6
        else:
            ts = last_ts
        last_ts = max(last_ts, ts)
        _export_record(rec, ts, epoch, states, tx, entered_guard)
    tx.close_all(last_ts)
    states.close_all(last_ts)


def _rank_metadata(pid: int, title: str, rank: int) -> list[dict[str, Any]]:
    """The metadata events that name a rank's process and its two tracks."""
    return [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": title}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": STATE_TID, "args": {"name": "state"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": TRANSITION_TID, "args": {"name": "transitions"}},
    ]


def _export_record(rec: Mapping[str, Any], ts: float, epoch: Any, states: _Track, tx: _Track,
                   on_guard: Callable[[Any, Any], None]) -> None:  # fmt: skip
    """One record as slices and instants on the rank's state and transition tracks.

    ``on_guard(epoch, trigger)``: the rank entered a guard (its time is ``tx.last_ts``).
    """
    event = rec.get("event")
    trigger = rec.get("trigger")
    state = rec.get("state")
    if event == TRANSITION_STARTED:
        if not states.stack and state:
            states.begin(state, ts, "state", {"epoch": epoch})
        tx.close_all(ts)  # a transition never closed: lost records
        tx.begin(label(trigger), ts, "transition",
                 {"epoch": epoch, "source": state, "dest": rec.get("dest"), "steps": rec.get("steps")})
    elif event == GUARD_ENTERED:
        tx.begin("guard", ts, "guard",
                 {"key": rec.get("key"), "collectives": rec.get("collectives"), "tensors": rec.get("tensors")})
        on_guard(epoch, trigger)
    elif event == GUARD_PASSED:
        tx.end("guard", ts, {"duration_s": rec.get("duration_s")})
    elif event == GUARD_FAILED:
        tx.instant(f"guard failed: {rec.get('error')}", ts, "failure",
                   {"error": rec.get("error"), "message": rec.get("message"), **error_fields(rec)})
        tx.end("guard", ts, {"failed": rec.get("error")})
    elif event == ACTION_STARTED:
        tx.begin(label(rec.get("action")), ts, "action", {"mem_before": rec.get("mem_before")})
    elif event == ACTION_FINISHED:
        tx.end(label(rec.get("action")), ts,
               {k: rec.get(k) for k in ("duration_s", "bytes_moved", "host_bytes", "mem_after")})
    elif event == TRANSITION_FINISHED:
        tx.end(label(trigger), ts, {"duration_s": rec.get("duration_s")})
        states.close_all(ts)
        states.begin(label(state), ts, "state", {"epoch": epoch})
    elif event in (TRANSITION_FAILED, TRANSITION_CANCELLED):
        tx.instant(event, ts, "failure",
                   {k: rec.get(k) for k in ("error", "message", "action", "phase") if k in rec})
        tx.end(label(trigger), ts, {event: rec.get("error")})
        if event == TRANSITION_FAILED:
            states.close_all(ts)
            states.begin("FAILED", ts, "state", {"epoch": epoch, "error": rec.get("error")})
    elif event == VERIFY_FAILED:
        tx.instant("verify failed", ts, "failure", {"tensors": rec.get("tensors"), "where": rec.get("where")})
    elif event == VERIFIED:
        tx.instant("verified", ts, "verify", {"tensors": rec.get("tensors")})
    elif event == RECOVERED:
        states.close_all(ts)
        states.begin(label(state), ts, "state", {"epoch": epoch, "recovered": True})
    elif event == MEMORY_SNAPSHOT:
        _memory_counters(rec, ts, tx)
    elif event != TRACE_OPENED:
        tx.instant(label(event), ts, "other", {k: v for k, v in rec.items() if k not in _COMMON})


def _memory_counters(rec: Mapping[str, Any], ts: float, tx: _Track) -> None:
    """A snapshot as counter tracks of the rank, in MiB: one per kind, a series per tag (docs/memory-drift.md)."""
    for kind, values in (("device", rec.get("device")), ("host", rec.get("host")), ("rss", {"process": rec.get("rss")})):
        if isinstance(values, dict):
            args = {str(tag): v / 2**20 for tag, v in values.items() if isinstance(v, (int, float))}
            if args:
                tx.emit({"name": f"{kind} memory (MiB)", "cat": "memory", "ph": "C", "ts": tx._ts(ts), "pid": tx.pid,
                         "tid": tx.tid, "args": args})  # fmt: skip


_COMMON = frozenset(("v", "rank", "world", "seq", "mono_ns", "wall", "event"))

