"""The consensus guard's failures: ranks that disagree, time out, are lost, or failed on their own.

No collective of the step ran when one of these is raised. ``LastSeen`` is
what the guard's store last heard from a rank, which these errors report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from miles_fsm.errors.base import MilesFsmError, list_ranks

__all__ = [
    "DivergenceKind",
    "GuardError",
    "GuardTimeoutError",
    "LastSeen",
    "PeerFailedError",
    "PeerLostError",
    "PeerNeverJoinedError",
    "PeerStepFailedError",
    "RankDivergenceError",
]


#: How the suspects of a divergence were found (``miles_fsm.blame``): ``changed``, ``tie`` or ``undecided``;
#: ``minority`` is the default of a ``RankDivergenceError`` built by hand.
DivergenceKind = Literal["minority", "tie", "changed", "undecided"]


@dataclass(frozen=True, slots=True)
class LastSeen:
    """What the store last heard from a rank: where it was, and when."""

    #: The rank.
    rank: int
    #: Its epoch then.
    epoch: int
    #: The transition it was in or at, by its trigger.
    trigger: str
    #: Its state then (the transition's source).
    state: str
    #: Where it was, in the words its peers' errors use: ``entered guard of``, ``passed guard of``,
    #: ``failed in <step> of``, ...
    phase: str
    #: When the rank said it: its wall clock (``time.time()``), in seconds.
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

    #: The epoch of the transition the ranks disagree on.
    epoch: int
    #: The transition's trigger, as this rank planned it.
    trigger: str
    #: The first compared field that differs (``tensor set``, ``collective plan``, ...).
    field: str
    #: That field's values, each with the ranks that hold it.
    groups: dict[str, tuple[int, ...]]
    #: What else the guard knows about the difference (a tensor-set diff), or "".
    detail: str
    #: The ranks to suspect first (see ``how``).
    culprits: tuple[int, ...]
    #: How the suspects were found: ``changed``, ``tie``, ``undecided`` or ``minority``.
    how: DivergenceKind
    #: Every differing field, each with its values and the ranks that hold them.
    differences: dict[str, dict[str, tuple[int, ...]]]
    #: Each rank's own position (epoch and trigger), where ranks were at different ones.
    positions: dict[int, str]

    def __init__(
        self,
        *,
        epoch: int,
        trigger: str,
        field: str,
        groups: Mapping[str, Sequence[int]],
        detail: str = "",
        culprits: Sequence[int] | None = None,
        how: DivergenceKind = "minority",
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

    #: The epoch of the transition whose guard timed out.
    epoch: int
    #: The transition's trigger.
    trigger: str
    #: The ranks that did not reach the guard.
    missing: tuple[int, ...]
    #: What the store last heard from each missing rank (None: nothing).
    last_seen: dict[int, LastSeen | None]
    #: The guard's timeout, in seconds.
    timeout_s: float
    #: Ranks that reported their own failure meanwhile, and what they said.
    failed: dict[int, LastSeen]

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

    #: The epoch of the transition whose guard lost its peers.
    epoch: int
    #: The transition's trigger.
    trigger: str
    #: The ranks the guard lost (empty when the store could not say which).
    missing: tuple[int, ...]
    #: What the store last heard from each missing rank (None: nothing).
    last_seen: dict[int, LastSeen | None]
    #: The transport's own error, as text.
    cause: str
    #: Ranks that reported their own failure meanwhile, and what they said.
    failed: dict[int, LastSeen]

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

    #: The epoch of the transition this rank could not start.
    epoch: int
    #: The transition's trigger.
    trigger: str
    #: What each failed rank told the store: its transition, its step and its error's type.
    failed: dict[int, LastSeen]
    #: The failed ranks, whose own errors are the cause.
    culprits: tuple[int, ...]

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

    #: The ranks that never built their guard.
    missing: tuple[int, ...]
    #: How long this rank waited for them, in seconds.
    timeout_s: float
    #: The lifecycle's name (``LifecycleConfig.name``), or None.
    name: str | None

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

    #: The epoch of the transition whose shared step failed.
    epoch: int
    #: The transition's trigger.
    trigger: str
    #: The step's name as traced (``engine.push_weights``).
    step: str
    #: The ranks that ran the step for the others and failed.
    ranks: tuple[int, ...]
    #: Each of those ranks' error, as text.
    errors: dict[int, str]

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
