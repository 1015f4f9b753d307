"""The shapes of what replay finds: the entries of ``Diagnosis`` and of ``--json``, one ``TypedDict`` each.

They are plain dicts at run time (``Diagnosis.to_json()`` is the ``--json``
contract, and a dict is what it holds), typed so that mypy checks every key
from the module that builds an entry to the report that reads it. Keys are
listed in the order the builders write them, which is the order ``--json``
prints. A field only some entries have is in a ``total=False`` part.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from miles_fsm.replay.fr_shapes import CollectiveEntry, FlightRecorderReport, FrGroup, FrPart

__all__ = ["Accusation", "BadLineEntry", "BeforeClose", "CollectiveEntry", "Culprit", "DamageEntry", "Difference",
           "DuplicateEntry", "FirstDivergence", "FlightRecorderReport", "FrGroup", "FrPart", "GuardFailure",
           "GuardReport", "IllegalMove", "Inside", "Leak", "LocatedFault", "MissingRank", "OutsideFailure", "OutsideStop",
           "RankEntry", "RankError", "RankStatus", "RankSummary", "Scalar", "StepFailure", "StopHow", "StoppedRank",
           "Straggler", "TraceProblems", "TruncatedEntry", "ValueGroup", "VerificationFailure", "WorstInstance"]

#: A value of ``trace_opened`` shown as written (``host``, ``pid``, ``strategy``).
Scalar = str | int | float | bool | None
#: How a stopped rank stopped (``StoppedRank.how``).
StopHow = Literal["crashed", "stuck", "unknown", "left", "cancelled", "silent", "stopped"]
#: A traced rank's status in ``Diagnosis.ranks``.
RankStatus = Literal["open", "failed", "empty", "done"]


class Culprit(TypedDict):
    """Whom the verdict blames: ``ranks`` only when the evidence decides, else the ``suspects``."""

    ranks: list[int]
    decided: bool
    suspects: list[int]
    epoch: int | None
    transition: str | None
    position: int


class Inside(TypedDict):
    """The transition a rank's trace ends inside."""

    transition: str
    epoch: int
    phase: str
    action: str | None


class RankError(TypedDict):
    """The failure a FAILED rank's last ``transition_failed`` gives."""

    type: str | None
    message: str
    transition: str | None
    epoch: int | None
    action: str | None


class _RankSummary(TypedDict):
    rank: int
    file: str
    status: RankStatus
    state: str | None
    epoch: int
    transitions: int
    finished: int
    failed: int
    last_event: str | None
    last_seq: int | None
    records: int
    verified: int
    closed: Literal["clean", "unclean"] | None
    host: Scalar
    pid: Scalar
    strategy: Scalar


class RankSummary(_RankSummary, total=False):
    """A traced rank's entry in ``Diagnosis.ranks``."""

    inside: Inside
    error: RankError


class MissingRank(TypedDict):
    """A rank asked for that left no trace file."""

    rank: int
    status: Literal["missing"]
    file: None


RankEntry = RankSummary | MissingRank


class ValueGroup(TypedDict):
    """The ranks that recorded one value of a field."""

    ranks: list[int]
    value: Any


class Difference(TypedDict):
    """A field the ranks disagree on, and who recorded which value."""

    field: str
    groups: list[ValueGroup]


class GuardReport(TypedDict):
    """What the guard itself said of a divergence it caught (its error's fields)."""

    field: str | None
    groups: Any
    culprits: list[int] | None
    detail: list[str]
    rank: int


class FirstDivergence(TypedDict):
    """Where the ranks' plans first differ, and whom that suspects (``miles_fsm.blame``)."""

    position: int
    epoch: int
    transition: str
    field: str
    also_differ: list[str]
    groups: list[ValueGroup]
    differences: list[Difference]
    guard_report: GuardReport | None
    culprits: list[int]
    how: str
    reason: str
    tie: bool
    decided: bool
    not_yet_at_guard: list[int]
    not_there: list[int]


class Accusation(TypedDict):
    """A surviving rank's record that blames another for stopping, and how."""

    kind: Literal["lost", "timeout", "located"]
    by: list[int]
    position: int
    epoch: int | None
    transition: str | None
    via: str


class StoppedRank(TypedDict):
    """A rank that stopped while others needed it: where, how, on what evidence."""

    rank: int
    state: str | None
    epoch: int | None
    transition: str | None
    position: int
    inside: str
    silent_s: float | None
    silent_basis: str
    how: StopHow
    closed: Literal["clean", "unclean"] | None
    evidence: str
    accused_by: list[int]
    located_by: list[int]
    waited_on_by: list[int]
    summary: str


class IllegalMove(TypedDict):
    """A recorded transition the machine's table forbids."""

    rank: int
    position: int
    line: int
    seq: int | None
    epoch: int | None
    trigger: str | None
    state: str | None
    reason: str


class VerificationFailure(TypedDict):
    """A rank's ``verify_failed``: the tensors that changed."""

    rank: int
    position: int
    epoch: int | None
    transition: str | None
    where: str
    tensors: list[str]
    line: int


class GuardFailure(TypedDict):
    """The ranks whose guard failed at one position with one error, and what they said."""

    position: int
    epoch: int | None
    transition: str | None
    error: str | None
    ranks: list[int]
    missing: list[int]
    field: str | None
    culprits: list[int] | None
    how: str | None
    groups: Any
    detail: str | None
    message: str


class StepFailure(TypedDict):
    """A transition that failed in a step (an action raised)."""

    rank: int
    position: int
    epoch: int | None
    transition: str | None
    action: str | None
    error: str | None
    message: str | None
    transport: str | None
    verification: bool


class OutsideFailure(TypedDict):
    """An error recorded outside any transition (a driver's own record, or a lifecycle left by it)."""

    rank: int
    position: int
    epoch: int | None
    event: str
    where: str | None
    error: str | None
    message: str
    transport: str | None
    culprits: list[int]
    after_failed: bool
    line: int


class OutsideStop(TypedDict):
    """A rank stopped from outside (its launcher's signal, time limit or death), and why."""

    rank: int
    position: int
    epoch: int | None
    state: str | None
    error: str | None
    reason: str | None
    signal: str | None
    failed: list[int]


class LocatedFault(TypedDict):
    """A fault a driver or the demo located itself (a record of its own with ``culprits``)."""

    rank: int
    event: str
    position: int
    epoch: int | None
    culprits: list[int]
    error: str | None
    where: str | None


class BeforeClose(TypedDict):
    """The record before a ``trace_closed``, in brief."""

    event: str | None
    subject: str | None
    wall: float | None


class WorstInstance(TypedDict):
    """The one instance of a transition slowest against its median."""

    epoch: int
    rank: int
    seconds: float
    median_s: float
    ratio: float


class _Straggler(TypedDict):
    transition: str
    instances: int
    slowest_rank: int
    slowest_s: float
    median_s: float
    ratio: float | None


class Straggler(_Straggler, total=False):
    """Per transition: the rank with the most own work time against the median (``straggler``: over the
    threshold). ``worst`` only where some instance has a ratio; ``straggler`` is always set."""

    worst: WorstInstance
    straggler: bool


class DamageEntry(TypedDict):
    """Damage to a file that parses (``model.Damage``)."""

    file: str
    rank: int | None
    line: int
    records: int
    where: str
    reason: str


class BadLineEntry(TypedDict):
    """A line that is not a trace record."""

    file: str
    line: int
    where: str
    reason: str
    text: str


class TruncatedEntry(TypedDict):
    """A file's last line, cut short."""

    file: str
    line: int
    where: str
    rank: int


class DuplicateEntry(TypedDict):
    """A record whose ``seq`` came before."""

    rank: int
    file: str
    seq: int
    line: int
    first_line: int


class TraceProblems(TypedDict):
    """What is wrong with the trace files themselves."""

    bad_lines: list[BadLineEntry]
    truncated: list[TruncatedEntry]
    lost_records: dict[str, int]
    duplicates: list[DuplicateEntry]
    damaged: list[DamageEntry]
    missing_ranks: list[int]
    run: str | None
    ignored: list[str]
    warnings: list[str]


class Leak(TypedDict):
    """Memory one rank kept alive cycle after cycle under a tag (``miles_fsm.replay.leaks``).

    ``kind``: ``device``, ``host`` or ``rss`` (tag ``process``); ``state``: where the growth
    passed the tolerance first; ``slope``: the repeated median over the cycles since its growth
    began, bytes per cycle; ``grown``: bytes over the baseline at the last cycle seen.
    """

    rank: int
    kind: str
    tag: str
    state: str
    first_cycle: int
    bytes_per_cycle: int
    slope: float
    grown: int
    baseline: int
    cycles: int
    #: The tag of the figure inside this one whose growth was taken out (``in_use`` less ``torch:reserved``),
    #: None when judged whole; ``grew_with``: tag -> bytes of the figures holding it that grew with it
    #: (``miles_fsm.memory_drift.INSIDE``).
    inside: str | None
    grew_with: dict[str, int]
