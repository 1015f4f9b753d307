"""Per-rank JSONL traces, written through structlog and flushed per line.

Each record is one ``os.write`` on an unbuffered file, so a SIGKILL loses at
most the line being written. A record takes the host's bound structlog
context (structlog's ``merge_contextvars``), a seq and both clocks, and is
rendered by orjson, inline in ``Tracer.emit``; the host application's
structlog and logging configuration are never touched.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import orjson
import structlog
import structlog.contextvars

from miles_fsm.errors import describe
from miles_fsm.trace.paths import index_path, trace_path
from miles_fsm.trace.schema import SCHEMA_VERSION, TRACE_CLOSED, TRACE_OPENED

__all__ = ["CloseHook", "NullTracer", "TraceIndexWarning", "TraceSink", "Tracer", "new_run_id", "trace_path"]


#: What ``Tracer.close()`` runs once the trace is closed: ``(trace file, rank)``. The lifecycle passes the
#: index writer (``miles_fsm.replay.index.write_index``); the writer itself never imports the reader.
CloseHook = Callable[[Path, int], object]


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
    merged = structlog.contextvars.merge_contextvars(logger, name, event_dict)
    # structlog (>= 24.1) merges into the event_dict it is given and returns it: a dict still.
    return cast("dict[str, Any]", merged)


# structlog keeps the variables bind_contextvars made in this private dict; without
# it (another structlog), every record goes through merge_contextvars.
_STRUCTLOG_VARS: dict[str, Any] | None = getattr(structlog.contextvars, "_CONTEXT_VARS", None)


_NEWLINE = orjson.OPT_APPEND_NEWLINE
_dumps = orjson.dumps


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
    ``close()`` writes ``trace_closed`` (a trace without it was cut off),
    then runs ``on_close``: the lifecycle's writes the trace's index beside
    it (``miles_fsm.replay.index``), its fold, which replay reads instead of
    the lines while the file is unchanged. A hook that raises leaves the
    trace whole: it is reported as a ``TraceIndexWarning``, never in place
    of the error the trace was closed with.
    """

    enabled = True

    def __init__(
        self, trace_dir: str | os.PathLike[str], *, rank: int, world: int, run: str | None = None,
        on_close: CloseHook | None = None, **meta: Any,
    ) -> None:  # fmt: skip
        self.run = run or new_run_id()
        self._rank = rank
        self._on_close = on_close
        self.path = trace_path(trace_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rotated_to = _rotate(self.path)
        # buffering=0: every record is one write(2), durable across SIGKILL.
        self._file = open(self.path, "ab", buffering=0)
        # A lifecycle dropped without close() still closes its trace quietly.
        self._finalizer = weakref.finalize(self, self._file.close)
        # The async API writes from the event-loop thread too: one lock keeps
        # the file's line order equal to seq order. Reentrant, so close() holds it
        # from its trace_closed to the descriptor's end: nothing lands after that
        # line (an RLock costs what a Lock does here).
        self._lock = threading.RLock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        # Each line starts with the rank's constant fields, rendered once, here;
        # a record renders only its own fields after them.
        self._context = {"v": SCHEMA_VERSION, "run": self.run, "rank": rank, "world": world}
        self._prefix = orjson.dumps(self._context, default=_default)[:-1] + b","
        # Per-rank and gap-free: replay finds a lost line by the gap.
        self._next_seq = itertools.count().__next__
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
        """Write one record: ``fields``, the host's bound structlog context, a seq and both clocks.

        The chain is structlog's, run inline: a bound logger's own work (level
        filtering, context copies, proxying) and a loop over processor calls
        cost more than the stamping, the rendering and the write together.
        """
        # ``fields`` is this call's own dict: the stamps go into it, nothing else holds it.
        fields["event"] = event
        host = _STRUCTLOG_VARS
        if host is None or host:
            fields = merge_host_context(None, "info", fields)
        # acquire/release rather than ``with``: half the cost on CPython 3.11, as safe under try/finally.
        self._acquire()
        try:
            # Monotonic ns order records within a rank; wall seconds are for humans.
            fields["seq"] = self._next_seq()
            fields["mono_ns"] = _monotonic_ns()
            fields["wall"] = _time()
            # Four lookups written out cost half of ``keys().isdisjoint``, the next best.
            if "v" in fields or "run" in fields or "rank" in fields or "world" in fields:
                # A record that sets a constant field itself wins, as a merged dict would have it.
                line = _dumps({**self._context, **fields}, default=_default, option=_NEWLINE)
            else:
                line = self._prefix + _dumps(fields, default=_default, option=_NEWLINE)[1:]
            _write(self._fd, line)
        finally:
            self._release()

    def close(self, *, epoch: int = 0, state: str | None = None, error: BaseException | None = None) -> None:
        """Write ``trace_closed`` (``clean`` unless ``error``) and close the file. Idempotent."""
        if not self._finalizer.alive:
            return
        record: dict[str, Any] = {"clean": error is None}
        if error is not None:
            record.update(describe(error))
        with self._lock:
            if not self._finalizer.alive:
                return  # another thread closed it meanwhile
            self.emit(TRACE_CLOSED, epoch=epoch, state=state, trigger=None, **record)
            # A later emit must fail, never write to whatever file reuses the descriptor number.
            self._fd = -1
            self._finalizer()
        if self._on_close is None:
            return
        try:
            self._on_close(self.path, self._rank)
        except Exception as exc:
            # The trace is whole either way; without its index replay reads its lines, only slower.
            warnings.warn(TraceIndexWarning(self.path, exc), stacklevel=2)


class TraceIndexWarning(UserWarning):
    """A closed trace's index could not be written: replay will read the trace's lines instead."""

    def __init__(self, trace: Path, cause: BaseException) -> None:
        self.trace = str(trace)
        self.cause = cause
        super().__init__(f"{trace}: its index was not written ({cause}); the trace is complete, and "
                         "`miles-fsm replay` reads it from its lines, only slower")  # fmt: skip


_write = os.write


def new_run_id() -> str:
    """A fresh run id: when it started, where, and a random part, so two runs never share one."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def _rotate(path: Path) -> Path | None:
    # An index describes the file it lies beside; it moves with it, and one left behind is stale.
    index = index_path(path)
    if not path.exists() or path.stat().st_size == 0:
        index.unlink(missing_ok=True)
        return None
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}.{n}")
        if not target.exists():
            path.rename(target)
            if index.exists():
                index.rename(index_path(target))
            return target
    raise AssertionError("unreachable")  # pragma: no cover
