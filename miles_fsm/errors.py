"""Every failure miles-fsm reports, one class each.

Each class keeps the facts as attributes and builds its message from them in
``__init__``, so a log line, a traceback and ``miles-fsm replay`` all say the
same thing. Each subclasses the stdlib error that fits, so callers that do
not know miles-fsm still catch them sensibly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BufferRoutingError",
    "ConfigError",
    "DefinitionError",
    "EngineRequestError",
    "EngineSessionError",
    "EngineUpdateError",
    "FaultLocatedError",
    "GuardError",
    "GuardTimeoutError",
    "HostCopyMissingError",
    "IneligibleModelError",
    "LastSeen",
    "MemoryReleasedError",
    "MemoryTagError",
    "MilesFsmError",
    "MissingDependencyError",
    "PeerLostError",
    "RankDivergenceError",
    "RankFailedError",
    "RecoveryError",
    "ResumeMemoryError",
    "TensorSetChangedError",
    "TransitionCancelled",
    "TransitionNotAllowed",
    "VerificationError",
    "WeightChecksumError",
    "WeightVersionError",
]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return shown + (f" and {more} more" if more > 0 else "")


class MilesFsmError(Exception):
    """Base class of every error miles-fsm raises on purpose."""


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

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.phase} {self.trigger} from {self.state} (epoch {self.epoch})"


class GuardError(MilesFsmError):
    """Base class of the consensus guard's failures. No collective of the step ran."""


class RankDivergenceError(GuardError, RuntimeError):
    """Ranks disagree on the transition or on the collectives it will issue."""

    def __init__(
        self,
        *,
        epoch: int,
        trigger: str,
        field: str,
        groups: Mapping[str, Sequence[int]],
        detail: str = "",
        culprits: Sequence[int] | None = None,
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.field = field
        self.groups = {k: tuple(v) for k, v in groups.items()}
        self.detail = detail
        minority = min(self.groups.values(), key=len) if self.groups else ()
        self.culprits = tuple(culprits) if culprits else tuple(minority)
        lines = [f"  ranks [{_ranks(v)}]: {k}" for k, v in self.groups.items()]
        super().__init__(
            f"ranks disagree on {field} before {trigger} (epoch {epoch}); no collective was "
            f"entered. Suspect rank(s) {_ranks(self.culprits)}.\n"
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
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.missing = tuple(missing)
        self.last_seen = dict(last_seen)
        self.timeout_s = timeout_s
        super().__init__(
            f"rank(s) {_ranks(self.missing)} did not reach the guard of {trigger} (epoch {epoch}) "
            f"within {timeout_s:g} s; {_describe_last(self.missing, self.last_seen)}. "
            "Look at those ranks' traces (`miles-fsm replay`) for what they are stuck in."
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
    ) -> None:
        self.epoch = epoch
        self.trigger = trigger
        self.missing = tuple(missing)
        self.last_seen = dict(last_seen)
        self.cause = cause
        who = f"rank(s) {_ranks(self.missing)}" if self.missing else "a peer rank"
        super().__init__(
            f"the guard of {trigger} (epoch {epoch}) lost its connection to {who} ({cause}); "
            f"{_describe_last(self.missing, self.last_seen)}. Check whether those processes "
            "crashed (exit code, OOM killer) and read their traces with `miles-fsm replay`."
        )


def _describe_last(missing: Sequence[int], last_seen: Mapping[int, LastSeen | None]) -> str:
    parts = []
    for r in missing:
        seen = last_seen.get(r)
        parts.append(str(seen) if seen is not None else f"rank {r}: never seen by the store")
    return "last seen: " + "; ".join(parts) if parts else "no rank is known to be missing"


class IneligibleModelError(MilesFsmError, ValueError):
    """The model's structure makes rematerialize unsafe."""

    def __init__(self, params: Sequence[str], reason: str) -> None:
        self.params = tuple(params)
        self.reason = reason
        super().__init__(
            f"rematerialize cannot rebuild {len(self.params)} param(s): {_names(self.params)} "
            f"({reason}). Put them in a DDP param buffer or among the backed-up extras, or "
            "use the backup strategy."
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


class VerificationError(MilesFsmError, RuntimeError):
    """Tensors came back with different bytes than they had before the offload."""

    def __init__(self, *, epoch: int, mismatched: Sequence[str], where: str = "trainer") -> None:
        self.epoch = epoch
        self.mismatched = tuple(mismatched)
        self.where = where
        super().__init__(
            f"{len(self.mismatched)} {where} tensor(s) differ from their pre-offload SHA256 "
            f"after epoch {epoch}: {_names(self.mismatched)}. Do not train on them: the restore "
            "or rematerialize path lost data. Recover from a checkpoint."
        )


class TensorSetChangedError(VerificationError):
    """The set of tensors itself changed between offload and verify."""

    def __init__(
        self, *, epoch: int, added: Sequence[str], removed: Sequence[str], where: str = "trainer"
    ) -> None:
        self.added = tuple(added)
        self.removed = tuple(removed)
        MilesFsmError.__init__(
            self,
            f"the {where} tensor set changed during epoch {epoch}: added [{_names(self.added)}], "
            f"removed [{_names(self.removed)}]. A param entered or left the buffers while "
            "offloaded; restore cannot be trusted.",
        )
        self.epoch = epoch
        self.mismatched = self.added + self.removed
        self.where = where


class MemoryTagError(MilesFsmError, RuntimeError):
    """A pause of a paused tag, or a resume of an active one, was refused."""

    def __init__(self, *, side: str, tag: str, op: str, paused: Sequence[str]) -> None:
        self.side = side
        self.tag = tag
        self.op = op
        self.paused = tuple(sorted(paused))
        state = "already paused" if op == "pause" else "not paused"
        super().__init__(
            f"refused to {op} {side} memory tag {tag!r}: it is {state} (paused now: "
            f"[{', '.join(self.paused)}]). torch_memory_saver and SGLang kill the process on "
            "this, so nothing was sent."
        )


class RecoveryError(MilesFsmError, RuntimeError):
    """A FAILED rank cannot be recovered to the state asked for."""

    def __init__(self, *, target: str, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"cannot recover to {target}: {reason}")


class WeightVersionError(MilesFsmError, RuntimeError):
    """The engine reports a different weight version than the one just pushed."""

    def __init__(self, *, engine: str, expected: str, actual: str | None) -> None:
        self.engine = engine
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"engine {engine} reports weight version {actual!r} after a push of {expected!r}; "
            "it is serving other weights than the trainer's. Push again before generating."
        )


class WeightChecksumError(MilesFsmError, RuntimeError):
    """After a push, the engine's own checksums of its weights differ from what they must be."""

    def __init__(self, *, engine: str, against: str, mismatched: Sequence[str], missing: Sequence[str]) -> None:
        self.engine = engine
        self.against = against
        self.mismatched = tuple(mismatched)
        self.missing = tuple(missing)
        parts = []
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} differ: [{_names(self.mismatched)}]")
        if self.missing:
            parts.append(f"{len(self.missing)} it does not report: [{_names(self.missing)}]")
        super().__init__(
            f"engine {engine}: after the push, its weight checksums disagree with {against}; "
            f"{'; '.join(parts)}. The push did not land as sent: push again before generating, and if it "
            "repeats, check the weight names and layout the trainer sends."
        )


class EngineRequestError(MilesFsmError, RuntimeError):
    """An engine rejected or failed a request."""

    def __init__(self, *, engine: str, op: str, status: int | None, message: str) -> None:
        self.engine = engine
        self.op = op
        self.status = status
        self.message = message
        code = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine {engine}: {op} failed ({code}): {message}")


class EngineSessionError(MilesFsmError, RuntimeError):
    """A weight-update session was misused or left open."""

    def __init__(self, *, engine: str, op: str, detail: str) -> None:
        self.engine = engine
        self.op = op
        self.detail = detail
        super().__init__(f"engine {engine}: weight-update session error during {op}: {detail}")


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


class FaultLocatedError(MilesFsmError, RuntimeError):
    """This rank failed because of another rank (or itself), and the evidence says which."""

    def __init__(self, *, rank: int, culprits: Sequence[int], evidence: str, cause: str) -> None:
        self.rank = rank
        self.culprits = tuple(sorted(culprits))
        self.evidence = evidence
        self.cause = cause
        super().__init__(
            f"rank {rank} stopped; culprit rank(s) {_ranks(self.culprits)}: {evidence}. "
            f"Error seen here: {cause}. Read the culprit's trace with `miles-fsm replay`."
        )


class EngineUpdateError(EngineRequestError):
    """One engine of a group failed mid-update; names it, the step, and every session still open."""

    def __init__(
        self,
        *,
        engine: str,
        op: str,
        status: int | None,
        message: str,
        closed: Sequence[str],
        left_open: Sequence[str],
    ) -> None:
        self.engine = engine
        self.op = op
        self.status = status
        self.message = message
        self.closed = tuple(closed)
        self.left_open = tuple(left_open)
        code = f"HTTP {status}" if status is not None else "no response"
        if self.left_open:
            sessions = (
                f" Weight-update sessions are STILL OPEN on [{', '.join(self.left_open)}]: end them "
                "(driver.close_sessions() or POST /end_weight_update) or restart those engines before "
                "the next push."
            )
        else:
            sessions = " No weight-update session is left open."
        closed_part = f" Sessions closed after the failure: [{', '.join(self.closed)}]." if self.closed else ""
        MilesFsmError.__init__(
            self,
            f"engine {engine}: weight update failed in {op} ({code}): {message.rstrip('.')}.{closed_part}{sessions} "
            "Treat the engines' weights as unknown: push again before generating.",
        )


class MissingDependencyError(MilesFsmError, ImportError):
    """An optional dependency a driver needs is not installed."""

    def __init__(self, *, package: str, extra: str | None, needed_for: str) -> None:
        self.package = package
        self.extra = extra
        self.needed_for = needed_for
        how = f"pip install 'miles-fsm[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{needed_for} needs the {package!r} package, which is not installed; run: {how}")


class HostCopyMissingError(MilesFsmError, KeyError):
    """A host copy was asked for a tag that was never backed up."""

    def __init__(self, *, tag: str, held: Sequence[str]) -> None:
        self.tag = tag
        self.held = tuple(sorted(held))
        super().__init__(
            f"no host copy of tag {tag!r} is held (held: [{', '.join(self.held)}]); "
            f"call backup({tag!r}) or copy(src, {tag!r}) first"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BufferRoutingError(MilesFsmError, RuntimeError):
    """megatron allocated a DDP buffer differently than the region routing expects."""

    def __init__(self, *, buffer: str, expected: Sequence[str], detail: str) -> None:
        self.buffer = buffer
        self.expected = tuple(expected)
        self.detail = detail
        super().__init__(
            f"could not place megatron's {buffer} in memory tags [{', '.join(self.expected)}]: {detail}. "
            "This megatron-core version allocates its param/grad buffers differently; pausing those "
            "tags would free nothing (or the wrong memory). Report the megatron-core version."
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


class ResumeMemoryError(MilesFsmError, MemoryError):
    """A resume was refused because the device has too little free memory for it."""

    def __init__(self, *, owner: str, tag: str, needed: int, free: int) -> None:
        self.owner = owner
        self.tag = tag
        self.needed = needed
        self.free = free
        super().__init__(
            f"{owner}: refused to resume memory tag {tag!r}: it needs at least {needed} bytes and the device "
            f"has {free} free. torch_memory_saver kills the process when a resume runs out of memory, so "
            "nothing was resumed; free device memory first (release the engine's tags, empty caches)."
        )


def describe(exc: BaseException) -> dict[str, Any]:
    """A JSON-friendly summary of an error for traces."""
    return {"error": type(exc).__name__, "message": str(exc)}
