"""The engine's failures, one class each, and the base every miles-fsm error shares.

Each class keeps its facts as attributes named like its ``__init__``
keywords and builds its message from them, so a log line, a traceback and
``miles-fsm replay`` all say the same thing. ``fields()`` is the one way to
read those facts: traces record it and replay reads it back, never the
message text. Errors pickle as they are (message, fields, notes), so they
cross process boundaries (multiprocessing, Ray) as themselves; ``crossable``
turns an exception that would not into a ``RankRaisedError`` stand-in. Each subclasses the stdlib
error that fits, so callers that do not know miles-fsm still catch them.

Errors of the lifecycle live in ``miles_fsm.states.errors``, errors of the
bindings in ``miles_fsm.drivers.errors``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "ConfigError",
    "DefinitionError",
    "GuardError",
    "GuardTimeoutError",
    "LastSeen",
    "MemoryReleasedError",
    "MilesFsmError",
    "PeerFailedError",
    "PeerLostError",
    "PeerNeverJoinedError",
    "PeerStepFailedError",
    "ProcessGroupMissingError",
    "RankDivergenceError",
    "RankFailedError",
    "RankRaisedError",
    "TransitionCancelled",
    "TransitionNotAllowed",
    "crossable",
    "describe",
    "list_names",
    "list_ranks",
    "plain",
    "crosses",
    "message_of",
    "transport_failure",
]


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


class DefinitionError(MilesFsmError, ValueError):
    """The transition table is malformed; raised when it is built."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid lifecycle definition:\n  - " + "\n  - ".join(self.problems))


class TransitionNotAllowed(MilesFsmError, RuntimeError):
    """A trigger was fired in a state that has no arrow for it. Nothing ran."""

    def __init__(
        self,
        state: str,
        trigger: str,
        allowed: Sequence[str] = (),
        failure: BaseException | None = None,
    ) -> None:
        self.state = state
        self.trigger = trigger
        self.allowed = tuple(allowed)
        self.failure = failure
        if failure is not None:
            hint = (
                f"the rank FAILED earlier ({type(failure).__name__}: {failure}); "
                "call Lifecycle.recover(to=...) once you know what state memory is in"
            )
        elif self.allowed:
            hint = "allowed here: " + ", ".join(self.allowed)
        else:
            hint = "no trigger leaves this state"
        super().__init__(f"trigger {trigger!r} is not allowed in state {state}; {hint}")


class TransitionCancelled(MilesFsmError, RuntimeError):
    """A transition was abandoned before its guard: no collective was entered."""

    def __init__(self, trigger: str, epoch: int) -> None:
        self.trigger = trigger
        self.epoch = epoch
        super().__init__(
            f"{trigger} (epoch {epoch}) was cancelled before its guard; this rank entered no "
            "collective and its state is unchanged, but the other ranks will fail their guard"
        )


@dataclass(frozen=True, slots=True)
class LastSeen:
    """What the store last heard from a rank: where it was, and when."""

    rank: int
    epoch: int
    trigger: str
    state: str
    phase: str
    wall: float
    #: Where a failed rank failed: the step's name as traced (None: in its guard, or no failure).
    step: str | None = None
    #: The type of the exception a failed rank raised (None: no failure, or not said).
    error: str | None = None

    def __str__(self) -> str:
        said = f" with {self.error}" if self.error else ""
        return f"rank {self.rank}: {self.phase} {self.trigger} from {self.state} (epoch {self.epoch}){said}"


class GuardError(MilesFsmError):
    """Base class of the consensus guard's failures. No collective of the step ran."""


class RankDivergenceError(GuardError, RuntimeError):
    """Ranks disagree on the transition or on the collectives it will issue.

    ``field`` is the first field that differs and ``groups`` its values by
    rank; ``differences`` holds every differing field the same way;
    ``positions`` each rank's own (epoch, trigger); ``how`` says how the
    suspects were found (``miles_fsm.blame``: ``changed``, ``tie`` or
    ``undecided``; ``minority`` is the default of an error built by hand).
    """

    def __init__(
        self,
        *,
        epoch: int,
        trigger: str,
        field: str,
        groups: Mapping[str, Sequence[int]],
        detail: str = "",
        culprits: Sequence[int] | None = None,
        how: str = "minority",
        differences: Mapping[str, Mapping[str, Sequence[int]]] | None = None,
        positions: Mapping[int, str] | None = None,
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.field = field
        self.groups = {k: tuple(v) for k, v in groups.items()}
        self.detail = detail
        minority = min(self.groups.values(), key=len) if self.groups else ()
        self.culprits = tuple(culprits) if culprits else tuple(minority)
        self.how = how
        self.differences = {f: {k: tuple(v) for k, v in g.items()} for f, g in (differences or {field: groups}).items()}
        self.positions = dict(positions or {})
        if how == "tie":
            suspect = f"It is a tie: nothing tells the sides apart; suspect every tied rank ({list_ranks(self.culprits)})."
        elif how == "changed":
            suspect = f"Suspect rank(s) {list_ranks(self.culprits)}: they changed it since every rank last agreed."
        elif how == "undecided":
            suspect = (f"Undecided: with no earlier agreement the group sizes do not say which side changed; suspect "
                       f"every rank of the differing groups ({list_ranks(self.culprits)}).")
        else:
            suspect = f"Suspect rank(s) {list_ranks(self.culprits)}: the only ranks that hold their value."
        lines = []
        for name, by_value in self.differences.items():
            lines.append(f"  {name}:")
            lines.extend(f"    ranks [{list_ranks(v)}]: {k}" for k, v in by_value.items())
        if self.positions and len(set(self.positions.values())) > 1:
            lines.append("  each rank's own position: " + "; ".join(f"rank {r}: {p}" for r, p in sorted(self.positions.items())))
        super().__init__(
            f"ranks disagree on {field} before {trigger} (epoch {epoch}); no collective was entered. {suspect}\n"
            + "\n".join(lines)
            + (f"\n  {detail}" if detail else "")
            + "\nEvery rank must plan from rank-uniform facts (names, shapes, dtypes, bucket "
            "layout), never from per-rank pause state. Run `miles-fsm replay` on the traces."
        )


class GuardTimeoutError(GuardError, TimeoutError):
    """Some ranks did not reach the guard within its timeout."""

    def __init__(
        self,
        *,
        epoch: int,
        trigger: str,
        missing: Sequence[int],
        last_seen: Mapping[int, LastSeen | None],
        timeout_s: float,
        failed: Mapping[int, LastSeen] | None = None,
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.missing = tuple(missing)
        self.last_seen = dict(last_seen)
        self.timeout_s = timeout_s
        self.failed = dict(failed or {})
        super().__init__(
            f"rank(s) {list_ranks(self.missing)} did not reach the guard of {trigger} (epoch {epoch}) "
            f"within {timeout_s:g} s; {_describe_last(self.missing, self.last_seen)}. "
            "Look at those ranks' traces (`miles-fsm replay`) for what they are stuck in."
            + _also_failed(self.failed)
        )


class PeerLostError(GuardError, ConnectionError):
    """The guard's connection to some ranks broke: their process is probably gone."""

    def __init__(
        self,
        *,
        epoch: int,
        trigger: str,
        missing: Sequence[int],
        last_seen: Mapping[int, LastSeen | None],
        cause: str,
        failed: Mapping[int, LastSeen] | None = None,
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.missing = tuple(missing)
        self.last_seen = dict(last_seen)
        self.cause = cause
        self.failed = dict(failed or {})
        who = f"rank(s) {list_ranks(self.missing)}" if self.missing else "a peer rank"
        super().__init__(
            f"the guard of {trigger} (epoch {epoch}) lost its connection to {who} ({cause}); "
            f"{_describe_last(self.missing, self.last_seen)}. Check whether those processes "
            "crashed (exit code, OOM killer) and read their traces with `miles-fsm replay`."
            + _also_failed(self.failed)
        )


class PeerFailedError(GuardError, RuntimeError):
    """Peer ranks failed on their own (a step raised) before this guard; the others cannot pass it.

    ``failed`` holds what each failed rank told the store: the transition,
    the step (None: its guard) and its exception's type. ``culprits`` are
    those ranks: their own errors are the cause, this one only follows.
    """

    def __init__(
        self, *, epoch: int, trigger: str, failed: Mapping[int, LastSeen], culprits: Sequence[int] | None = None
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.failed = dict(failed)
        self.culprits = tuple(culprits) if culprits else tuple(sorted(self.failed))
        super().__init__(
            f"{_failed_text(self.failed)}; so the guard of {trigger} (epoch {epoch}) cannot pass, and this rank "
            "entered no collective. Their error is the cause: read rank(s) "
            f"{list_ranks(self.culprits)}'s error and trace first (`miles-fsm replay`); this rank only follows it."
        )


class PeerNeverJoinedError(GuardError, TimeoutError):
    """Some ranks never built their guard (their ``Lifecycle``), so nobody's can be built: it is collective."""

    def __init__(self, *, missing: Sequence[int], timeout_s: float, name: str | None = None) -> None:
        self.missing = tuple(missing)
        self.timeout_s = timeout_s
        self.name = name
        what = f"the guard of lifecycle {name!r}" if name else "their guard"
        super().__init__(
            f"rank(s) {list_ranks(self.missing)} never built {what} (their Lifecycle, or Guard.from_group) "
            f"within {timeout_s:g} s, and building it is collective, so this rank cannot build its own. Their "
            "process most likely failed before (a driver's __init__ raised): read their error and exit code. "
            "Every rank must build its Lifecycles, in the same order."
        )


class PeerStepFailedError(GuardError, RuntimeError):
    """A step that one rank ran for several (an engine call) failed there; every rank fails with it."""

    def __init__(self, *, epoch: int, trigger: str, step: str, ranks: Sequence[int], errors: Mapping[int, str]) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.step = step
        self.ranks = tuple(ranks)
        self.errors = dict(errors)
        said = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.errors.items()))
        super().__init__(
            f"{step} of {trigger} (epoch {epoch}) failed on rank(s) {list_ranks(self.ranks)}, which ran it for "
            f"this rank too ({said}); every rank stops here together. Read those ranks' traces first."
        )


def _failed_text(failed: Mapping[int, LastSeen]) -> str:
    """``rank(s) 1 failed: rank 1: RuntimeError in cast_main_to_params of rematerialize (epoch 1)``."""
    said = "; ".join(
        f"rank {r}: {s.error or 'an error'} in {s.step} of {s.trigger} (epoch {s.epoch})" if s.step else
        f"rank {r}: {s.error or 'an error'}, {s.phase} {s.trigger} (epoch {s.epoch})"
        for r, s in sorted(failed.items())
    )  # fmt: skip
    return f"rank(s) {list_ranks(sorted(failed))} failed: {said}"


def _also_failed(failed: Mapping[int, LastSeen]) -> str:
    return f"\nAlso, {_failed_text(failed)}; read their errors first: they may be the cause." if failed else ""


def _describe_last(missing: Sequence[int], last_seen: Mapping[int, LastSeen | None]) -> str:
    parts = []
    for r in missing:
        seen = last_seen.get(r)
        parts.append(str(seen) if seen is not None else f"rank {r}: never seen by the store")
    return "last seen: " + "; ".join(parts) if parts else "no rank is known to be missing"


class ProcessGroupMissingError(MilesFsmError, RuntimeError):
    """The environment says this is one rank of several, but torch.distributed is not initialized."""

    def __init__(self, *, world_size: int, rank: str | None) -> None:
        self.world_size = world_size
        self.rank = rank
        super().__init__(
            f"WORLD_SIZE={world_size} (RANK={rank}) but torch.distributed is not initialized, so this rank would "
            "run alone: its guards would check nothing and its trace would claim rank 0. Call "
            "torch.distributed.init_process_group() before building the Lifecycle, or pass guard=Guard.solo() "
            "to run one rank on purpose."
        )


class ConfigError(MilesFsmError, ValueError):
    """The configuration violates constraints; every violation is listed."""

    def __init__(self, violations: Sequence[str], what: str = "configuration") -> None:
        self.violations = tuple(violations)
        self.what = what
        super().__init__(
            f"{what} violates {len(self.violations)} constraint(s):\n  - "
            + "\n  - ".join(self.violations)
        )


class MemoryReleasedError(MilesFsmError, RuntimeError):
    """Work was asked of memory that is released (or came back without its contents)."""

    def __init__(self, *, owner: str, op: str, tags: Sequence[str], reason: str = "") -> None:
        self.owner = owner
        self.op = op
        self.tags = tuple(sorted(tags))
        self.reason = reason
        why = reason or "they are released"
        super().__init__(
            f"{owner} cannot {op}: memory tag(s) [{', '.join(self.tags)}] are not usable ({why}). "
            "Resume them and reload their contents (push weights, restore) first."
        )


class RankFailedError(MilesFsmError, RuntimeError):
    """A task waited for a state, and the rank went FAILED instead."""

    def __init__(self, *, rank: int, waiting_for: str, trigger: str, epoch: int, step: str | None, cause: str) -> None:
        self.rank = rank
        self.waiting_for = waiting_for
        self.trigger = trigger
        self.epoch = epoch
        self.step = step
        self.cause = cause
        super().__init__(
            f"rank {rank} went FAILED in {trigger} (epoch {epoch}, in {step or 'guard'}: {cause}) while "
            f"a task waited for {waiting_for}; it will not get there until someone calls "
            "recover(to=...) once it is known what state memory is in."
        )


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
    except Exception:  # noqa: BLE001 - whatever pickling raises (TypeError, PicklingError, ...), it cannot cross
        return False
    return True


def message_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as broken:  # noqa: BLE001 - a __str__ that raises must not hide the error it describes
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
