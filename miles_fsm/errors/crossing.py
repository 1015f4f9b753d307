"""An error that must cross a process boundary: ``crossable`` keeps it, or sends a stand-in that does.

Launchers hand a rank's exception to the controller by pickling it
(multiprocessing, Ray); one that does not survive that round trip (it does
not pickle, or it pickles but cannot be unpickled: an ``__init__`` with
required arguments that ``args`` does not hold) would be lost there.
"""

from __future__ import annotations

import pickle
from typing import Any

from miles_fsm.errors.base import MilesFsmError, message_of

__all__ = ["RankRaisedError", "crossable", "crosses"]


class RankRaisedError(MilesFsmError, RuntimeError):
    """A rank raised an exception that cannot cross to the controller (it does not pickle, or it pickles
    but cannot be unpickled); this stand-in crosses instead, with the type name, message and traceback
    text of the original, and why the original could not cross. It round-trips through pickle itself."""

    #: The rank that raised the original exception.
    rank: int
    #: The original exception's type, by its qualified name (``OSError``, ``MyError``).
    type_name: str
    #: The original exception's message (``str()`` of it).
    message: str
    #: The original's traceback, formatted as Python prints it.
    traceback_text: str
    #: Why the original could not cross: which half of the pickle round trip failed, and its error.
    why: str

    def __init__(self, *, rank: int, type_name: str, message: str, traceback_text: str,
                 why: str = "it does not pickle") -> None:  # fmt: skip
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        self.why = why
        super().__init__(
            f"rank {rank} raised {type_name}: {message} (the exception itself could not be sent to the "
            f"controller: {why}; its traceback is in traceback_text, below)\n" + traceback_text
        )


def crossable(exc: BaseException, *, rank: int) -> BaseException:
    """``exc`` if it crosses a process boundary intact, else a ``RankRaisedError`` that keeps its
    type name, message and traceback text, and says why it could not cross."""
    import traceback

    why = _round_trip_failure(exc)
    if why is None:
        return exc
    return RankRaisedError(rank=rank, type_name=type(exc).__qualname__, message=message_of(exc),
                           traceback_text="".join(traceback.format_exception(exc)), why=why)  # fmt: skip


def crosses(value: Any) -> bool:
    """Whether ``value`` survives a pickle round trip: what crossing a process does to it."""
    return _round_trip_failure(value) is None


def _round_trip_failure(value: Any) -> str | None:
    """None if ``value`` survives ``pickle.loads(pickle.dumps(value))``, else which half failed, and how."""
    # Any exception here is the answer (a user's __reduce__ or __init__ may raise anything), kept as text.
    try:
        data = pickle.dumps(value)
    except Exception as exc:
        return f"it does not pickle ({type(exc).__name__}: {message_of(exc)})"
    try:
        pickle.loads(data)
    except Exception as exc:
        return f"it pickles, but cannot be unpickled ({type(exc).__name__}: {message_of(exc)})"
    return None
