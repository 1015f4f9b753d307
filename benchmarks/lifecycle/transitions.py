"""One cycle's rows: each transition's time, bytes and overhead, and the offload and wake phases."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_fsm.trace.schema import TRANSITION_FAILED, TRANSITION_FINISHED, TRANSITION_STARTED, VERIFIED
from miles_fsm.states import CYCLE as _CYCLE
from miles_fsm.states import DEFINITION, State

#: The cycle's trigger names, from the table; the offload is TRAINING -> PAUSED, the wake PAUSED -> SYNCED.
CYCLE = tuple(t.value for t in _CYCLE)
OFFLOAD = tuple(t.value for t in DEFINITION.path(State.TRAINING, State.PAUSED))
WAKE = tuple(t.value for t in DEFINITION.path(State.PAUSED, State.SYNCED))
#: Steps that are verification, not data movement.
VERIFY_STEPS = ("record_digests", "verify")


def trace_events(trace_file: Path) -> dict[tuple[int, str], int]:
    """Records per (epoch, trigger) transition, from one rank's trace."""
    import orjson

    counts: dict[tuple[int, str], int] = {}
    current: tuple[int, str] | None = None
    for line in trace_file.read_bytes().splitlines():
        rec = orjson.loads(line)
        event = rec.get("event")
        if event == TRANSITION_STARTED:
            current = (rec["epoch"], rec["trigger"])
            counts[current] = 0
        if current is not None:
            counts[current] += 1
            if event in (TRANSITION_FINISHED, TRANSITION_FAILED):
                current = None
    return counts


def verified_waits(trace_file: Path) -> dict[int, float]:
    """Per epoch, the seconds the host waited for the digests recorded at offload (the ``verified``
    record's ``waited_s``: the record pass runs beside the offload and is joined later)."""
    import orjson

    out: dict[int, float] = {}
    for line in trace_file.read_bytes().splitlines():
        rec = orjson.loads(line)
        if rec.get("event") == VERIFIED:
            out[rec["epoch"]] = float(rec.get("waited_s") or 0.0)
    return out


def transition_row(r: Any, events: int, moved_extra: int, limits: Mapping[str, Any]) -> dict[str, Any]:
    steps = {s.name: s.duration_s for s in r.steps}
    verify_s = sum(v for k, v in steps.items() if k.startswith(VERIFY_STEPS))
    steps_s = sum(steps.values())
    trace_s = events * limits["trace_event_us"] * 1e-6
    has_guard = any(s.name.startswith("param_sync") for s in r.steps) or r.guard_s > 0
    guard_model_s = limits["gloo"]["guard_us"] * 1e-6 if has_guard else 0.0
    overhead = max(r.guard_s, guard_model_s) + trace_s
    return {
        "s": r.duration_s,
        "bytes": (r.bytes_moved or 0) + moved_extra,
        "step_bytes": r.bytes_moved,
        "memory_bytes": moved_extra,
        "steps_s": steps,
        "verify_s": verify_s,
        "guard_s": r.guard_s,
        "guard_model_s": guard_model_s,
        "events": events,
        "trace_s": trace_s,
        "nonstep_s": r.duration_s - steps_s,
        "guard_trace_fraction": overhead / r.duration_s if r.duration_s > 0 else None,
    }


def phase(
    cycle: Mapping[str, Any], names: Sequence[str], cross: str, limit_GBps: float | None, wall_s: float | None = None
) -> dict[str, Any]:
    """One phase (offload or wake) of a cycle. ``wall_s``: measured until the device finished
    (else the transitions' own times); verification steps are taken out for the data path."""
    rows = [cycle["transitions"][n] for n in names]
    s = wall_s if wall_s is not None else sum(r["s"] for r in rows)
    data_s = s - sum(r["verify_s"] for r in rows)
    nbytes = sum(cycle[cross][n] for n in names)
    gbps = nbytes / data_s / 1e9 if data_s > 0 else None
    return {
        "s": s,
        "data_path_s": data_s,
        "host_bytes_crossed": nbytes,
        "GBps": gbps,
        "limit_GBps": limit_GBps,
        "vs_limit": gbps / limit_GBps if gbps is not None and limit_GBps else None,
    }


def verification_share(cycle: Mapping[str, Any]) -> dict[str, Any]:
    """What verification costs a cycle: the host's time in its steps plus its wait for the recorded
    digests (``verify_wait_s``), against the whole cycle and against the transitions alone.

    The whole cycle is wall time: the train step, then from the offload's start to the resume's end
    (``cycle_wall_s``), which includes waiting for the device to finish the wake's queued copies;
    without that figure (results before issue 27's overlap), the train step plus the transitions.
    """
    steps_s = sum(t["verify_s"] for t in cycle["transitions"].values())
    verify_s = steps_s + cycle.get("verify_wait_s", 0.0)
    transitions_s = sum(t["s"] for t in cycle["transitions"].values())
    cycle_s = cycle.get("train_s", 0.0) + cycle.get("cycle_wall_s", transitions_s)
    return {
        "verify_s": verify_s,
        "verify_steps_s": steps_s,
        "cycle_s": cycle_s,
        "verify_share": verify_s / cycle_s if cycle_s > 0 else None,
        "verify_share_of_transitions": verify_s / transitions_s if transitions_s > 0 else None,
    }
