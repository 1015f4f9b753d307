"""The base every miles-fsm error shares, and how traces record an error.

Each class keeps its facts as attributes named like its ``__init__``
keywords and builds its message from them, so a log line, a traceback and
``miles-fsm replay`` all say the same thing. ``fields()`` is the one way to
read those facts: traces record it and replay reads it back, never the
message text. Errors pickle as they are (message, fields, notes), so they
cross process boundaries (multiprocessing, Ray) as themselves. Each
subclasses the stdlib error that fits, so callers that do not know
miles-fsm still catch them.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

__all__ = ["MilesFsmError", "describe", "list_names", "list_ranks", "message_of", "plain", "transport_failure"]


def list_ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def list_names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return shown + (f" and {more} more" if more > 0 else "")


class MilesFsmError(Exception):
    """Base class of every error miles-fsm raises on purpose.

    A subclass's facts are its ``__init__`` keyword parameters, kept as
    attributes of the same names: ``fields()`` returns them, and pickling
    rebuilds the error from them.
    """

    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A class without an __init__ of its own below this one takes a message
        # (``Exception``'s ``*args``): it has no facts, only its message.
        owner = next(c for c in cls.__mro__ if "__init__" in c.__dict__)
        if not issubclass(owner, MilesFsmError):
            cls._fields = ()
            return
        params = inspect.signature(cls.__init__).parameters
        cls._fields = tuple(n for n, p in params.items()
                            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))  # fmt: skip

    def fields(self) -> dict[str, Any]:
        """The error's facts, by name, as they are (``plain`` makes them JSON-ready).

        A parameter that a user's subclass did not keep as an attribute is no fact: it is left out.
        """
        return {name: getattr(self, name) for name in self._fields if hasattr(self, name)}

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt as it was, not by calling __init__ again: ``args`` holds the message, __dict__ every
        # fact (and what was added after construction, such as add_note()'s notes). That works for
        # every subclass, whatever its __init__ takes, and the message comes back as it was said.
        return (_rebuild, (type(self), self.args), dict(self.__dict__))


def _rebuild(cls: type[MilesFsmError], args: tuple[Any, ...]) -> MilesFsmError:
    try:
        exc = cls.__new__(cls, *args)
    except TypeError:  # MemoryError's __new__ refuses subclasses ("not safe"); the base's makes the same object
        exc = BaseException.__new__(cls, *args)
    exc.args = args
    return exc


def plain(value: Any) -> Any:
    """A JSON-ready copy of an error's field: what traces record."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, BaseException):
        return describe(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [plain(v) for v in items]
    return str(value)


def message_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as broken:
        return f"<str() of it raised {type(broken).__name__}: {broken}>"


def describe(exc: BaseException) -> dict[str, Any]:
    """A JSON-ready summary of an error for traces: its type, message and fields.

    Errors that are not ours carry no fields; for those, ``transport`` says
    whether the error is a lost peer or a timeout of a collective, judged
    here once, where the live exception is at hand, so that no reader ever
    has to parse message text.
    """
    out: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, MilesFsmError):
        out["fields"] = plain(exc.fields())
    else:
        out["transport"] = transport_failure(exc)
    return out


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crash", "peer lost",
              "peer closed", "broken pipe")  # fmt: skip
_TIMED_OUT = ("timed out", "timeout", "time out")


def transport_failure(exc: BaseException) -> str | None:
    """``"peer_lost"``, ``"timeout"`` or None: what a collective's own error means.

    gloo reports both as a bare ``RuntimeError`` (NCCL as ``DistBackendError``),
    so after the types the message is all there is to go on.
    """
    if isinstance(exc, ConnectionError):
        return "peer_lost"
    if isinstance(exc, TimeoutError):
        return "timeout"
    text = str(exc).lower()
    if any(p in text for p in _PEER_LOST):
        return "peer_lost"
    if any(p in text for p in _TIMED_OUT):
        return "timeout"
    return None
