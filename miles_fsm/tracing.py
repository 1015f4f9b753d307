"""Per-rank JSONL traces, written through structlog and flushed per line.

Each record is one ``os.write`` on an unbuffered file, so a SIGKILL loses at
most the line being written. structlog is used through ``wrap_logger`` with
our own processor chain: the host application's structlog and logging
configuration are never touched.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog

from miles_fsm.schema import SCHEMA_VERSION, TRACE_OPENED

__all__ = ["NullTracer", "TraceSink", "Tracer", "trace_path"]



def trace_path(trace_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its trace."""
    return Path(trace_dir) / f"rank-{rank}.jsonl"


class SequenceNumberer:
    """Stamps a per-rank, gap-free sequence number on every record."""

    def __init__(self) -> None:
        self._next = itertools.count().__next__

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict["seq"] = self._next()
        return event_dict


def add_clocks(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Monotonic ns for ordering within a rank, wall seconds for humans."""
    event_dict["mono_ns"] = time.monotonic_ns()
    event_dict["wall"] = time.time()
    return event_dict


def _default(obj: Any) -> Any:
    # Enums, paths, dataclasses without orjson support: fall back to str().
    return str(obj)


def render_json(_logger: Any, _name: str, event_dict: dict[str, Any]) -> bytes:
    return orjson.dumps(event_dict, default=_default)


class TraceSink(Protocol):
    """What the lifecycle writes records to."""

    @property
    def enabled(self) -> bool: ...

    def emit(self, event: str, **fields: Any) -> None: ...

    def close(self) -> None: ...


class NullTracer:
    """Tracing off: ``emit`` does nothing."""

    enabled = False

    def emit(self, event: str, **fields: Any) -> None:
        return None

    def close(self) -> None:
        return None


class Tracer:
    """Writes ``<trace_dir>/rank-<r>.jsonl`` for one rank.

    An existing file is renamed to ``rank-<r>.jsonl.<n>`` first, so a restart
    never mixes two runs in one file and never destroys the earlier one.
    """

    enabled = True

    def __init__(self, trace_dir: str | os.PathLike[str], *, rank: int, world: int, **meta: Any) -> None:
        self.path = trace_path(trace_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rotated_to = _rotate(self.path)
        # buffering=0: every record is one write(2), durable across SIGKILL.
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - owned until close()
        # A lifecycle dropped without close() still closes its trace quietly.
        self._finalizer = weakref.finalize(self, self._file.close)
        # The async API writes from the event-loop thread too: one lock keeps
        # the file's line order equal to seq order.
        self._lock = threading.Lock()
        self._log = structlog.wrap_logger(
            structlog.BytesLogger(self._file),
            processors=[SequenceNumberer(), add_clocks, render_json],
            wrapper_class=structlog.make_filtering_bound_logger(0),
            context_class=dict,
            cache_logger_on_first_use=True,
        ).bind(v=SCHEMA_VERSION, rank=rank, world=world)
        self.emit(
            TRACE_OPENED,
            epoch=0,
            state=None,
            trigger=None,
            pid=os.getpid(),
            host=socket.gethostname(),
            rotated_to=str(self.rotated_to) if self.rotated_to else None,
            **meta,
        )

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._log.info(event, **fields)

    def close(self) -> None:
        self._finalizer()


def _rotate(path: Path) -> Path | None:
    if not path.exists() or path.stat().st_size == 0:
        return None
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}.{n}")
        if not target.exists():
            path.rename(target)
            return target
    raise AssertionError("unreachable")  # pragma: no cover
