"""What the trace reader folds a rank's trace into: positions, notes, illegal moves, the machine's table.

Plain data, shared by the reader (``miles_fsm.replay.read``) and the
diagnosis modules that read its output.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_fsm.errors import MilesFsmError
from miles_fsm.replay.checks import MAX_RANKS, machine_problem, plain_int
from miles_fsm.replay.shapes import BeforeClose
from miles_fsm.trace.schema import SCHEMA_VERSION

__all__ = [
    "CANCELLED",
    "FAILED",
    "FINISHED",
    "NO_GUARD",
    "OPEN",
    "UNCLOSED",
    "BadLine",
    "Damage",
    "EpochRange",
    "Illegal",
    "MachineTable",
    "Note",
    "Duplicate",
    "Position",
    "RankTrace",
    "TraceDirError",
    "identity_damage",
]

#: Outcome codes of a position, one byte each.
FINISHED, FAILED, CANCELLED, OPEN, UNCLOSED = b"F", b"X", b"C", b"O", b"U"

#: Guard fields of a position whose guard was skipped (no collectives planned).
NO_GUARD: tuple[Any, ...] = (None, (), None)


class TraceDirError(MilesFsmError, ValueError):
    """The trace directory cannot be read or holds no trace: bad input, exit code 2."""

    #: The directory, or the file in it, that could not be read.
    path: str
    #: Why, in words (what the one line on stderr says after the path).
    reason: str

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        # Raised in reader worker processes: MilesFsmError's pickling brings it back as itself.
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRange:
    """Epochs ``first..last`` inclusive; ``last`` None means open-ended."""

    first: int
    last: int | None

    @classmethod
    def parse(cls, text: str) -> EpochRange:
        """``3`` (one epoch), ``2:5`` or ``2:`` (from 2 on)."""
        lo, sep, hi = text.partition(":")
        try:
            first = int(lo) if lo else 0
            last = (int(hi) if hi else None) if sep else first
        except ValueError:
            raise ValueError(f"--epoch wants N, A:B or A:, got {text!r}") from None
        if last is not None and last < first:
            raise ValueError(f"--epoch {text}: the range is empty ({last} < {first})")
        return cls(first=first, last=last)

    def __contains__(self, epoch: object) -> bool:
        return isinstance(epoch, int) and epoch >= self.first and (self.last is None or epoch <= self.last)

    def __str__(self) -> str:
        return str(self.first) if self.last == self.first else f"{self.first}:{'' if self.last is None else self.last}"


@dataclass(frozen=True, kw_only=True, slots=True)
class BadLine:
    """A line that is not a trace record: reported with file:line, then skipped."""

    path: str
    line: int
    reason: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Damage:
    """What makes a file other than what its writer left, though its lines parse: never ok.

    Records of another rank, world or schema version (a copy of another
    rank's file, a flipped bit in an identity field), a rank beyond its
    world, a trace changed after its writer closed it, a name that is not a
    rank file's. ``line`` is the first line it shows at (0: the whole file)
    and ``records`` how many records it concerns (0: not counted by record).
    """

    path: str
    line: int
    records: int
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else self.path


@dataclass(frozen=True, kw_only=True, slots=True)
class Duplicate:
    """A record whose ``seq`` came before: an exact copy is dropped, another record is a bad line."""

    seq: int
    line: int
    first_line: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Illegal:
    """A recorded transition that the machine definition forbids."""

    rank: int
    position: int
    line: int
    seq: int | None
    epoch: int | None
    trigger: str | None
    state: str | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Note:
    """A notable record (a failure, a recovery), kept whole; there are few of them."""

    position: int
    line: int
    event: str
    record: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    """Where a rank's trace ends, or what it was inside when it stopped."""

    index: int
    epoch: int
    trigger: str
    source: str
    phase: str  # "planning", "guard", "step" or "between steps"
    action: str | None
    since_wall: float | None
    since_mono_ns: int | None


@dataclass(kw_only=True, slots=True)
class RankTrace:
    """One rank's trace, folded. Arrays are indexed by position (n-th transition started)."""

    rank: int
    path: str
    #: The world size the file's first record gives (None: none, or not a world size); every record must agree.
    world: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    lines: int = 0
    records: int = 0
    max_seq: int = -1
    #: Records not where their ``seq`` puts them; the file was then read in ``seq`` order.
    out_of_order: int = 0
    duplicates: list[Duplicate] = field(default_factory=list)
    #: Run id -> records of it in the file, in the order first seen (None: records without ``run``).
    runs: dict[str | None, int] = field(default_factory=dict)
    #: The run this fold kept (the only one, or the one asked for); records of other runs are not folded.
    run: str | None = None
    #: The ``trace_closed`` record, when the trace ends in one (None: it was cut off).
    closed: dict[str, Any] | None = None
    #: Records after a ``trace_closed`` (the file was written to after it was closed).
    after_close: int = 0
    bad: list[BadLine] = field(default_factory=list)
    truncated: BadLine | None = None
    #: Damage that parses (``Damage``): the file is not what its writer left.
    damaged: list[Damage] = field(default_factory=list)
    epochs: array[int] = field(default_factory=lambda: array("q"))
    sigs: array[int] = field(default_factory=lambda: array("l"))
    guards: array[int] = field(default_factory=lambda: array("l"))
    work_s: array[float] = field(default_factory=lambda: array("d"))
    outcome: bytearray = field(default_factory=bytearray)
    sig_table: list[tuple[str, str, str, tuple[str, ...]]] = field(default_factory=list)
    guard_table: list[tuple[Any, ...]] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    illegal: list[Illegal] = field(default_factory=list)
    verified: int = 0
    #: [position, tensors] of each ``verified`` record: at which transition, how many tensors it checked.
    verifications: list[list[int]] = field(default_factory=list)
    #: The file is the one its writer closed, as its index proves (its size and CRC-32); False: read from its
    #: lines alone, where an edit that keeps every record well-formed and consistent cannot be seen.
    proven: bool = False
    unknown_events: int = 0
    opened: int = 0
    first_wall: float | None = None
    first_mono_ns: int | None = None
    last_wall: float | None = None
    #: The record before ``trace_closed``, in brief (``event``, ``subject``: its action or trigger,
    #: ``wall``): where a rank stopped from outside was last active, since its stop wrote the close.
    before_close: BeforeClose | None = None
    last_mono_ns: int | None = None
    last_event: str | None = None
    #: What the last record names: its action, else its trigger (None: neither).
    last_subject: str | None = None
    last_seq: int | None = None
    last_line: int = 0
    state: str | None = None
    epoch: int = 0
    open: Position | None = None
    #: The writer's transition table (None: the trace names none; legality is then not checked).
    table: MachineTable | None = None

    @property
    def positions(self) -> int:
        return len(self.outcome)

    @property
    def lost(self) -> int:
        """Records missing by sequence number (garbage lines, a truncated tail, a gap)."""
        return max(0, self.max_seq + 1 - self.records)

    @property
    def clean(self) -> bool:
        """The trace ends in a clean ``trace_closed``, with nothing written after it."""
        return self.closed is not None and self.closed.get("clean") is True and not self.after_close

    @property
    def strategy(self) -> str | None:
        return self.meta.get("strategy")

    @property
    def guard_timeout_s(self) -> float | None:
        value = self.meta.get("guard_timeout_s")
        return float(value) if isinstance(value, (int, float)) else None

    def note(self, in_transition: bool, line: int, event: str, rec: dict[str, Any]) -> None:
        """Keep a notable record whole, at the open transition's position, else the last one's."""
        index = len(self.outcome) if in_transition else len(self.outcome) - 1
        self.notes.append(Note(position=index, line=line, event=event, record=rec))

    def track(self, rec: dict[str, Any], line: int) -> None:
        """Where the trace ends (or starts): this record's clock, event, state and epoch."""
        # Any record can be last, even one the fold found bad: only values of the right type are kept.
        wall, mono = rec.get("wall"), plain_int(rec.get("mono_ns"))
        wall = wall if wall.__class__ in (int, float) and abs(wall) < 1e12 else None
        if self.first_wall is None and wall is not None:
            self.first_wall, self.first_mono_ns = wall, mono
        if wall is not None:
            self.last_wall = wall
        if mono is not None:
            self.last_mono_ns = mono
        event, subject = rec.get("event"), rec.get("action") or rec.get("trigger")
        self.last_event = event if event.__class__ is str else None
        self.last_subject = subject if subject.__class__ is str else None
        self.last_seq = plain_int(rec.get("seq"))
        self.last_line = line
        state = rec.get("state", self.state)
        if state is None or state.__class__ is str:
            self.state = state
        epoch = plain_int(rec.get("epoch"))
        if epoch is not None:
            self.epoch = epoch

    def note_before_close(self, rec: dict[str, Any]) -> None:
        """Keep ``rec``, the record just before ``trace_closed``, in brief (only values of the right type)."""
        event, subject, wall = rec.get("event"), rec.get("action") or rec.get("trigger"), rec.get("wall")
        self.before_close = {
            "event": event if event.__class__ is str else None,
            "subject": subject if subject.__class__ is str else None,
            "wall": wall if wall.__class__ in (int, float) and abs(wall) < 1e12 else None,
        }

    def trigger_at(self, index: int) -> str:
        return self.sig_table[self.sigs[index]][0]

    def describe_at(self, index: int) -> dict[str, Any]:
        """The intent recorded at a position, field by field (None: not recorded)."""
        trigger, source, dest, steps = self.sig_table[self.sigs[index]]
        g = self.guards[index]
        key, collectives, tensors = (None, None, None) if g < 0 else self.guard_table[g]
        return {
            "epoch": self.epochs[index],
            "trigger": trigger,
            "source state": source,
            "destination": dest,
            "steps": list(steps),
            "guarded": None if g < 0 else key is not None,
            "collectives": None if collectives is None else list(collectives),
            "tensors": tensors,
            "plan fingerprint": key,
        }


@dataclass(frozen=True, slots=True)
class MachineTable:
    """The writer's transition table, as its ``trace_opened`` record gives it."""

    initial: str
    failed: str
    cycle_states: frozenset[str]
    #: (source, trigger) -> (dest, the steps this rank's plan may run, in order)
    arrows: dict[tuple[str, str], tuple[str, tuple[str, ...]]]

    @classmethod
    def parse(cls, described: Any) -> MachineTable | None:
        """The table of a ``machine`` field, or None if it is missing or malformed (``machine_problem`` says why)."""
        if machine_problem(described) is not None:
            return None
        try:
            arrows = {(src, trig): (dest, tuple(str(x) for x in steps))
                      for src, trig, dest, steps in described["transitions"]}  # fmt: skip
            initial, failed = str(described["initial"]), str(described["failed"])
            states = frozenset(str(x) for x in described["states"]) - {initial, failed}
        except (KeyError, TypeError, ValueError):
            return None
        return cls(initial=initial, failed=failed, cycle_states=states, arrows=arrows)

    def knows(self, state: Any) -> bool:
        """Whether ``state`` is one of the machine's states."""
        return state.__class__ is str and (state in self.cycle_states or state == self.initial or state == self.failed)

    def allowed(self, state: str | None) -> list[str]:
        return [trig for (src, trig) in self.arrows if src == state]

    def forbids(self, machine: str | None, trigger: Any, source: Any, dest: Any, steps: tuple[str, ...]) -> str | None:
        """Why the machine, in state ``machine``, forbids this recorded transition; None if it allows it."""
        if machine == self.failed:
            return f"{trigger} fired while {self.failed} (no recover in between)"
        legal = self.arrows.get((machine or "", trigger if isinstance(trigger, str) else ""))
        if legal is None:
            allowed = self.allowed(machine)
            return f"no arrow for {trigger} out of {machine} (allowed: {', '.join(allowed) or 'none'})"
        if source != machine:
            return f"recorded source {source}, but the machine is in {machine}"
        if dest != legal[0]:
            return f"recorded destination {dest}, but {trigger} leads to {legal[0]}"
        if not _subsequence(steps, legal[1]):
            return f"steps {list(steps)} are not steps of {trigger} ({', '.join(legal[1])})"
        return None


def _subsequence(part: Sequence[str], whole: Sequence[str]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def identity_damage(t: RankTrace, path: str | os.PathLike[str], world: Any, foreign: dict[tuple[str, Any], list[int]]) -> None:
    """The file's world, and its records whose rank, world or schema is not the file's, as damage."""
    t.world = world if world.__class__ is int and 0 < world <= MAX_RANKS else None
    for (name, value), (n, line) in foreign.items():
        if name == "rank":
            what = f"of rank {value}, not rank {t.rank}" + (" (a copy or a link of another rank's file?)"
                                                             if line == 1 and n == t.records else "")  # fmt: skip
        elif name == "world":
            what = f"of world {value}" + ("" if t.world is None else f", not the world {t.world} of its first record")
        else:
            what = f"of schema v{value}; replay reads v{SCHEMA_VERSION}" + (" (v1 traces are never ok)"
                                                                            if value == 1 else "")  # fmt: skip
        t.damaged.append(Damage(path=str(path), line=line, records=n, reason=f"{n} record(s) {what}"))
    if t.world is not None and t.rank >= t.world:
        t.damaged.append(Damage(path=str(path), line=0, records=0,
                                reason=f"rank {t.rank} is beyond the world of {t.world} its records give"))  # fmt: skip
