"""An error that must cross a process boundary: ``crossable`` keeps it, or sends a stand-in that does.

Launchers hand a rank's exception to the controller by pickling it
(multiprocessing, Ray); one that does not pickle would be lost there.
"""

from __future__ import annotations

from typing import Any

from miles_fsm.errors.base import MilesFsmError, message_of

__all__ = ["RankRaisedError", "crossable", "crosses"]


class RankRaisedError(MilesFsmError, RuntimeError):
    """A rank raised an exception that cannot cross to the controller (it does not pickle); this
    stand-in crosses instead, with the type name, message and traceback text of the original."""

    def __init__(self, *, rank: int, type_name: str, message: str, traceback_text: str) -> None:
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        super().__init__(
            f"rank {rank} raised {type_name}: {message} (the exception itself could not be sent to the "
            "controller, as it does not pickle: its traceback is in traceback_text, below)\n" + traceback_text
        )


def crossable(exc: BaseException, *, rank: int) -> BaseException:
    """``exc`` if it crosses a process boundary intact, else a ``RankRaisedError`` that keeps its
    type name, message and traceback text."""
    import traceback

    if crosses(exc):
        return exc
    return RankRaisedError(rank=rank, type_name=type(exc).__qualname__, message=message_of(exc),
                           traceback_text="".join(traceback.format_exception(exc)))  # fmt: skip


def crosses(value: Any) -> bool:
    """Whether ``value`` survives a pickle round trip: what crossing a process does to it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True
