"""Publishing this rank's arrival at a guard to the store, off the hot path, and what becomes of its errors.

The store is the guard's memory for failures only: the agreement itself is a
gloo all-reduce that needs no store. So a store error never fails a guard that
agreed; it is kept, and handed to the guard, which warns with it
(``GuardStoreWarning``) when it passes and names it on the error it raises when
it fails, where the store's stale records would otherwise mislead.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from miles_fsm.errors import LastSeen

__all__ = [
    "GuardStatus",
    "GuardStoreWarning",
    "Publisher",
    "Sighting",
    "note_on",
    "phase_text",
    "read_record",
    "record",
    "said_failed",
    "warn_each",
]

#: What a rank's record in the store says it did: built its guard, entered one, failed, or left its
#: failed state. The guard decides by it; the sentence shown for it (``phase_text``) is never parsed.
GuardStatus = Literal["joined", "arrived", "failed", "recovered"]

_SAID: dict[GuardStatus, str] = {"joined": "built its guard", "arrived": "entered guard of", "recovered": "recovered from"}

#: A rank that waits at a guard longer than this publishes its arrival to the
#: store, so that if some rank never comes, every rank that did can be told
#: apart from it. Guards that pass quickly, the normal case, never touch the
#: store: a store round trip costs as much as the guard's all-reduce itself.
_PUBLISH_AFTER_S = 0.02
_POLL_S = 0.01

#: How long ``close`` waits for a store write in flight (a dead store's host can hold one up to the
#: store's own timeout); the thread, told to stop, ends after that write whatever close waited.
_JOIN_S = 5.0


class GuardStoreWarning(UserWarning):
    """A guard could not write this rank's record to the store; the guard itself still works."""

    def __init__(self, *, rank: int, key: str, cause: BaseException) -> None:
        self.rank = rank
        self.key = key
        self.cause = cause
        super().__init__(
            f"rank {rank} could not write its guard record {key!r} to the torch.distributed store "
            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}). Guards still agree "
            "without the store, but if a peer is lost, the ranks may name this one with a stale state: check "
            "that the store's host (MASTER_ADDR:MASTER_PORT, or the store= given) is up and reachable"
        )


def phase_text(status: GuardStatus, step: str | None = None) -> str:
    """What peers are shown of a record (``LastSeen.phase``): ``failed in <the step, or guard> of``,
    ``entered guard of``, ``recovered from`` or ``built its guard``."""
    return f"failed in {step or 'guard'} of" if status == "failed" else _SAID[status]


def record(epoch: int, trigger: str, state: str, status: GuardStatus, *, step: str | None = None,
           error: str | None = None, phase: str | None = None) -> bytes:  # fmt: skip
    """One rank's record in the store: where it is, or where it failed (the step, None: its guard, and
    the exception's type). ``phase``: the words peers are shown for it, when not ``phase_text``'s."""
    body: dict[str, Any] = {"epoch": epoch, "trigger": trigger, "state": state, "status": status, "wall": time.time()}
    if phase is not None:
        body["phase"] = phase
    if status == "failed":
        body.update(step=step, error=error)
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Sighting:
    """A rank's record as read back from the store: its status, and what its peers are shown of it."""

    status: GuardStatus
    seen: LastSeen

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def body(self) -> dict[str, Any]:
        """As ``read_record`` takes it back (a failure's report carries it to the other survivors)."""
        return {**dataclasses.asdict(self.seen), "status": self.status}


def said_failed(sighting: Sighting | None) -> bool:
    """Whether the store holds a failure for the rank (None: it holds nothing of it)."""
    return sighting is not None and sighting.failed


def read_record(body: dict[str, Any], *, rank: int | None = None) -> Sighting:
    """``rank``'s ``record``, or a ``Sighting.body`` (which names its rank), parsed."""
    status: GuardStatus = body.pop("status")  # our own records' field: one of GuardStatus's
    phase = body.pop("phase", None)
    if rank is not None:
        body["rank"] = rank
    seen = LastSeen(**body, phase=phase if phase is not None else phase_text(status, body.get("step")))
    return Sighting(status, seen)


def warn_each(kept: Sequence[GuardStoreWarning]) -> None:
    """Warn with each kept store error, from the guard's caller (the guard itself passed)."""
    for warning in kept:
        warnings.warn(warning, stacklevel=3)


def note_on(error: BaseException, kept: Sequence[GuardStoreWarning]) -> None:
    """Say each kept store error on the guard's ``error``: a note (a warning before Python 3.11, which has none)."""
    for warning in kept:
        if hasattr(error, "add_note"):
            error.add_note(f"miles-fsm: {warning}")
        else:  # pragma: no cover - Python 3.10
            warnings.warn(warning, stacklevel=3)


class Publisher:
    """Publishes this rank's arrival at a guard, but only once it has waited.

    ``arm``/``disarm`` are plain attribute writes on the hot path. A thread
    polls every ``_POLL_S`` and writes an arrival still armed after
    ``_PUBLISH_AFTER_S``. ``set_now`` writes synchronously, for failure paths.
    A write that fails is kept (``take_errors``) and not retried: the next
    arrival is tried afresh, so a store that comes back is used again.
    """

    def __init__(self, store: Any, key: str, *, rank: int) -> None:
        self._store = store
        self._key = key
        self._rank = rank
        self._armed: tuple[float, bytes] | None = None
        self._lock = threading.Lock()
        self._errors: list[GuardStoreWarning] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-fsm-guard-publisher", daemon=True)
        self._thread.start()

    def arm(self, record: bytes) -> None:
        self._armed = (time.monotonic() + _PUBLISH_AFTER_S, record)

    def disarm(self) -> None:
        self._armed = None

    def set_now(self, record: bytes) -> None:
        with self._lock:
            self._store.set(self._key, record)

    def keep(self, key: str, exc: BaseException) -> None:
        """Keep a store error met on ``key`` for the guard to report."""
        with self._lock:
            self._errors.append(GuardStoreWarning(rank=self._rank, key=key, cause=exc))

    def take_errors(self) -> tuple[GuardStoreWarning, ...]:
        """The store errors kept since the last call, each handed over once."""
        if not self._errors:  # the hot path: one attribute read
            return ()
        with self._lock:
            errors, self._errors = self._errors, []
        return tuple(errors)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread and join it. Idempotent."""
        self._armed = None
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)

    def _run(self) -> None:
        published: tuple[float, bytes] | None = None
        while not self._stop.wait(_POLL_S):
            armed = self._armed
            if armed is None or armed is published or time.monotonic() < armed[0]:
                continue
            with self._lock:
                if self._armed is not armed:  # the guard passed (or failed) meanwhile
                    continue
                try:
                    self._store.set(self._key, armed[1])
                except RuntimeError as exc:  # torch's store errors (DistStoreError) are RuntimeErrors
                    self._errors.append(GuardStoreWarning(rank=self._rank, key=self._key, cause=exc))
                published = armed  # tried: a failed write is reported, not retried every poll
