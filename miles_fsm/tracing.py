"""Per-rank JSONL traces, written through structlog and flushed per line.

Each record is one ``os.write`` on an unbuffered file, so a SIGKILL loses at
most the line being written. structlog is used through ``wrap_logger`` with
our own processor chain: the host application's structlog and logging
configuration are never touched.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog
import structlog.contextvars

from miles_fsm.errors import describe
from miles_fsm.schema import SCHEMA_VERSION, TRACE_CLOSED, TRACE_OPENED

__all__ = ["NullTracer", "TraceSink", "Tracer", "new_run_id", "trace_path"]



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

    def close(self, *, epoch: int = 0, state: str | None = None, error: BaseException | None = None) -> None: ...


class NullTracer:
    """Tracing off: ``emit`` does nothing."""

    enabled = False

    def emit(self, event: str, **fields: Any) -> None:
        return None

    def close(self, *, epoch: int = 0, state: str | None = None, error: BaseException | None = None) -> None:
        return None


class Tracer:
    """Writes ``<trace_dir>/rank-<r>.jsonl`` for one rank.

    An existing file is renamed to ``rank-<r>.jsonl.<n>`` first, so a restart
    never mixes two runs in one file and never destroys the earlier one.
    ``run`` is stamped on every record: replay tells runs apart by it.
    ``close()`` writes ``trace_closed``: a trace without it was cut off.
    """

    enabled = True

    def __init__(
        self, trace_dir: str | os.PathLike[str], *, rank: int, world: int, run: str | None = None, **meta: Any
    ) -> None:
        self.run = run or new_run_id()
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
        self._context = {"v": SCHEMA_VERSION, "run": self.run, "rank": rank, "world": world}
        # structlog's pipeline as one loop over its processors, without a bound
        # logger around it: the wrapper's own work (level filtering, context
        # copies, proxying) cost more than the processors and the write together.
        self._processors = (structlog.contextvars.merge_contextvars, SequenceNumberer(), add_clocks, render_json)
        self._out = structlog.BytesLogger(self._file)
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
        event_dict: Any = {**self._context, **fields, "event": event}
        with self._lock:
            for proc in self._processors:
                event_dict = proc(None, "info", event_dict)
            self._out.msg(event_dict)

    def close(self, *, epoch: int = 0, state: str | None = None, error: BaseException | None = None) -> None:
        """Write ``trace_closed`` (``clean`` unless ``error``) and close the file. Idempotent."""
        if not self._finalizer.alive:
            return
        record: dict[str, Any] = {"clean": error is None}
        if error is not None:
            record.update(describe(error))
        self.emit(TRACE_CLOSED, epoch=epoch, state=state, trigger=None, **record)
        self._finalizer()


def new_run_id() -> str:
    """A fresh run id: when it started, where, and a random part, so two runs never share one."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def _rotate(path: Path) -> Path | None:
    if not path.exists() or path.stat().st_size == 0:
        return None
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}.{n}")
        if not target.exists():
            path.rename(target)
            return target
    raise AssertionError("unreachable")  # pragma: no cover
