"""The trace schema: every event name, the fields each record carries, and the record builders.

Every writer (the machine, the async API, the demo) and every reader
(replay, the demo's progress, the benchmarks) takes its names from here, so
a rename is one edit and a reader can never look for an event no writer
writes. ``docs/trace-schema.md`` documents the same table; a test keeps the
two equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "ACTION_FINISHED",
    "ACTION_STARTED",
    "CANCEL_DEFERRED",
    "COMMON_FIELDS",
    "EVENTS",
    "GUARD_ENTERED",
    "GUARD_FAILED",
    "GUARD_PASSED",
    "MEMORY_DRIFT",
    "MEMORY_SNAPSHOT",
    "RECOVERED",
    "SCHEMA_VERSION",
    "STORE_UNREACHABLE",
    "TRACE_CLOSED",
    "TRACE_OPENED",
    "TRANSITION_CANCELLED",
    "TRANSITION_FAILED",
    "TRANSITION_FINISHED",
    "TRANSITION_STARTED",
    "VERIFIED",
    "VERIFY_FAILED",
    "CLOSING",
    "error_fields",
]

#: Bumped when a field changes meaning; replay checks it. 2: the machine's
#: table in ``trace_opened``; error facts under ``fields``; ``run`` on every
#: record; ``trace_closed`` ends a trace that was closed, not cut off.
SCHEMA_VERSION = 2

TRACE_OPENED = "trace_opened"
TRANSITION_STARTED = "transition_started"
TRANSITION_CANCELLED = "transition_cancelled"
GUARD_ENTERED = "guard_entered"
GUARD_PASSED = "guard_passed"
GUARD_FAILED = "guard_failed"
ACTION_STARTED = "action_started"
ACTION_FINISHED = "action_finished"
VERIFIED = "verified"
VERIFY_FAILED = "verify_failed"
TRANSITION_FINISHED = "transition_finished"
TRANSITION_FAILED = "transition_failed"
CANCEL_DEFERRED = "cancel_deferred"
RECOVERED = "recovered"
STORE_UNREACHABLE = "store_unreachable"
TRACE_CLOSED = "trace_closed"
#: One rank's memory at a state it reached (docs/memory-drift.md); ``epoch`` is the cycle.
MEMORY_SNAPSHOT = "memory_snapshot"
#: A figure that grew cycle by cycle past the tolerance, found live.
MEMORY_DRIFT = "memory_drift"

#: On every record: stamped by the tracer (``v``, ``run``, ``rank``,
#: ``world``, ``seq``, ``mono_ns``, ``wall``, ``event``) or given by the
#: writer. ``run`` is the run's id, the same on every rank of one run.
COMMON_FIELDS = ("v", "run", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger")

_ERROR = ("error", "message")

#: Event -> the fields it carries besides the common ones. Error records
#: also carry ``fields`` (a miles-fsm error's facts) or ``transport``
#: (``peer_lost`` / ``timeout`` / null, for errors that are not ours).
EVENTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        TRACE_OPENED: ("pid", "host", "machine", "rotated_to"),
        TRANSITION_STARTED: ("dest", "steps"),
        TRANSITION_CANCELLED: _ERROR,
        GUARD_ENTERED: ("key", "collectives", "tensors"),
        GUARD_PASSED: ("duration_s",),
        GUARD_FAILED: _ERROR,
        ACTION_STARTED: ("action", "mem_before"),
        ACTION_FINISHED: ("action", "duration_s", "bytes_moved", "host_bytes", "mem_before", "mem_after"),
        VERIFIED: ("tensors", "scheme", "waited_s"),
        VERIFY_FAILED: ("tensors", "where", "scheme"),
        TRANSITION_FINISHED: ("source", "duration_s"),
        TRANSITION_FAILED: ("source", "action", "phase", *_ERROR),
        CANCEL_DEFERRED: ("phase", "action"),
        RECOVERED: ("after",),
        STORE_UNREACHABLE: _ERROR,
        TRACE_CLOSED: ("clean",),
        MEMORY_SNAPSHOT: ("device", "host", "rss"),
        MEMORY_DRIFT: ("kind", "tag", "at", "first_cycle", "bytes_per_cycle", "slope", "grown", "policy"),
    }
)

#: Events that close an open ``transition_started``.
CLOSING = frozenset((TRANSITION_FINISHED, TRANSITION_FAILED, TRANSITION_CANCELLED))


def error_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record's error facts (a miles-fsm error's ``fields()``), or ``{}``."""
    fields = record.get("fields")
    return fields if isinstance(fields, dict) else {}
