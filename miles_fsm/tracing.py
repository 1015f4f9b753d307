"""Per-rank JSONL traces, written through structlog and flushed per line.

Each record is one ``os.write`` on an unbuffered file, so a SIGKILL loses at
most the line being written. The records go through a structlog processor
chain of our own, run as structlog runs it (one loop); the host
application's structlog and logging configuration are never touched.
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


class RecordStamper:
    """Stamps a per-rank, gap-free sequence number and both clocks on every record.

    Monotonic ns order records within a rank; wall seconds are for humans.
    One processor, not two: a processor call costs as much as the stamping.
    """

    def __init__(self) -> None:
        self._next = itertools.count().__next__

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict["seq"] = self._next()
        event_dict["mono_ns"] = _monotonic_ns()
        event_dict["wall"] = _time()
        return event_dict


_monotonic_ns, _time = time.monotonic_ns, time.time


def _default(obj: Any) -> Any:
    # Enums, paths, dataclasses without orjson support: fall back to str().
    return str(obj)


def merge_host_context(logger: Any, name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog's ``merge_contextvars``, skipped while the host has nothing bound.

    ``merge_contextvars`` walks every context variable of the process on
    each record; asking structlog's own variables whether any holds a value
    costs a fraction of that.
    """
    if _STRUCTLOG_VARS is not None:
        for var in _STRUCTLOG_VARS.values():
            if var.get() is not Ellipsis:
                break
        else:
            return event_dict
    return structlog.contextvars.merge_contextvars(logger, name, event_dict)


# structlog keeps the variables bind_contextvars made in this private dict; without
# it (another structlog), every record goes through merge_contextvars.
_STRUCTLOG_VARS: dict[str, Any] | None = getattr(structlog.contextvars, "_CONTEXT_VARS", None)


class LineRenderer:
    """Renders a record as one JSON line that starts with the rank's constant fields.

    The constant fields (schema version, run, rank, world) are rendered once,
    here; each record renders only its own fields after them. A record that
    sets one of the constant fields itself is rendered whole, its value
    winning, as a merged dict would have it.
    """

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = dict(context)
        self._keys = tuple(context)
        self._prefix = orjson.dumps(self._context, default=_default)[:-1] + b","

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> bytes:
        # The keys view looks up the few constant keys; a set would hash every key of the record.
        if event_dict and event_dict.keys().isdisjoint(self._keys):
            return self._prefix + orjson.dumps(event_dict, default=_default, option=_NEWLINE)[1:]
        return orjson.dumps({**self._context, **event_dict}, default=_default, option=_NEWLINE)


_NEWLINE = orjson.OPT_APPEND_NEWLINE


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
        self._acquire, self._release = self._lock.acquire, self._lock.release
        context = {"v": SCHEMA_VERSION, "run": self.run, "rank": rank, "world": world}
        # structlog's pipeline as one loop over its processors, without a bound
        # logger around it: the wrapper's own work (level filtering, context
        # copies, proxying) cost more than the processors and the write together.
        # The last processor renders the whole line, newline included.
        self._processors = (RecordStamper(), LineRenderer(context))
        # While the host has bound no structlog context there is nothing to merge: the
        # check is one global lookup, the processor call it saves costs more.
        self._with_host_context = (merge_host_context, *self._processors)
        self._fd = self._file.fileno()
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
        # ``fields`` is this call's own dict: the processors add to it, nothing else holds it.
        fields["event"] = event
        event_dict: Any = fields
        host = _STRUCTLOG_VARS
        processors = self._processors if host is not None and not host else self._with_host_context
        # acquire/release rather than ``with``: half the cost on CPython 3.11, as safe under try/finally.
        self._acquire()
        try:
            for proc in processors:
                event_dict = proc(None, "info", event_dict)
            _write(self._fd, event_dict)
        finally:
            self._release()

    def close(self, *, epoch: int = 0, state: str | None = None, error: BaseException | None = None) -> None:
        """Write ``trace_closed`` (``clean`` unless ``error``) and close the file. Idempotent."""
        if not self._finalizer.alive:
            return
        record: dict[str, Any] = {"clean": error is None}
        if error is not None:
            record.update(describe(error))
        self.emit(TRACE_CLOSED, epoch=epoch, state=state, trigger=None, **record)
        with self._lock:
            # A later emit must fail, never write to whatever file reuses the descriptor number.
            self._fd = -1
            self._finalizer()


_write = os.write


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
