"""``miles-fsm replay --flight-recorder DIR`` with no lifecycle traces: a job's own Flight Recorder dumps.

What torch's ``torchfrtrace`` says of each process group (``fr_groups``),
the one-line summary of where the ranks are, and the ranks that left no
dump. The JSON keeps the shape of ``Diagnosis.to_json()``: the keys that
only traces can fill are empty, and ``flight_recorder`` holds the rest.
Exit codes as with traces: 0 every collective matched, 3 a group out of
step (``stuck``) or a dump missing (``incomplete``), 2 bad input. A group
torch cannot judge for a member's missing dump is ``incomplete``, not
``stuck``: it names no rank whose collective differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from miles_fsm import flight_recorder as fr
from miles_fsm.ranks import plural_ranks, rank_ranges
from miles_fsm.replay.fr_align import RankCollective
from miles_fsm.replay.fr_groups import FrGroups, GroupVerdict, analyse
from miles_fsm.replay.fr_native import DEFAULT_PREFIX, NativeDumps, checked, load_native_dir
from miles_fsm.replay.problems import Verdict
from miles_fsm.replay.shapes import CollectiveEntry, TraceProblems

__all__ = ["FrOnlyReplay", "collectives", "replay_dumps"]


def _no_trace_problems() -> TraceProblems:
    """No trace was read, so none is damaged: the contract's object, every list empty (a new one per call)."""
    return TraceProblems(bad_lines=[], truncated=[], lost_records={}, duplicates=[], damaged=[], missing_ranks=[],
                         run=None, ignored=[], warnings=[])  # fmt: skip

@dataclass(frozen=True, slots=True)
class FrOnlyReplay:
    """The dumps of one folder, and what torch's alignment and replay make of them."""

    folder: str
    native: NativeDumps
    groups: FrGroups
    last: tuple[RankCollective, ...]  # each rank's newest collective (of any group)
    in_flight: tuple[RankCollective, ...]  # each rank's last collective on each group (the Perfetto slices)

    @property
    def missing(self) -> tuple[int, ...]:
        """Ranks that left no dump: below the highest dumped one, or members of a group its peers name."""
        members = {r for g in self.groups.groups for r in g.members}
        return tuple(sorted(set(self.native.missing) | (members - set(self.native.dumps))))

    @property
    def verdict(self) -> str:
        if self.groups.out_of_step:
            return Verdict.STUCK
        return Verdict.INCOMPLETE if self.missing or self.groups.undecided else Verdict.OK

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == Verdict.OK else 3

    @property
    def headline(self) -> str:
        bad = self.groups.out_of_step
        if bad:
            more = f" (and {len(bad) - 1} more group(s) out of step)" if len(bad) > 1 else ""
            return f"{bad[0].line}{more}"
        undecided = ", ".join(g.label for g in self.groups.undecided)
        if self.missing or undecided:
            who = f"no dump from {plural_ranks(list(self.missing))}"
            if undecided:
                return f"{who}; torch cannot judge {undecided} without it, and found no group out of step"
            return f"{who}; the others' collectives all matched"
        return self.groups.line

    def culprit(self) -> dict[str, Any] | None:
        """The first group out of step's culprit (``GroupVerdict.blamed``), in the contract's shape."""
        bad = self.groups.out_of_step
        if not bad:
            return None
        ranks, decided = bad[0].blamed
        return {"ranks": list(ranks) if decided else [], "decided": decided, "suspects": list(ranks),
                "epoch": None, "transition": None, "position": None, "group": bad[0].label,
                "collective": f"{bad[0].op} #{bad[0].seq}"}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        missing = list(self.missing)
        notes = [f"no lifecycle traces: read {len(self.native.dumps)} Flight Recorder dump(s) of torch's format "
                 f"({self.native.prefix}<rank>) from {self.folder}"]  # fmt: skip
        return {
            "verdict": self.verdict, "headline": self.headline, "culprit": self.culprit(),
            "world": max((*self.native.dumps, *missing), default=-1) + 1, "ranks": [], "missing_ranks": missing,
            "first_divergence": None, "stuck": [], "illegal": [], "verification": [], "guard_failures": [],
            "failures": [], "outside_failures": [], "stragglers": [], "trace_problems": _no_trace_problems(),
            "notes": notes, "leaks": [],
            "flight_recorder": {
                "line": self.groups.line, "mismatch": bool(self.groups.out_of_step),
                "ranks": [r.to_json() for r in self.last], "missing": missing, "problems": [],
                "groups": self.groups.to_json(), "format": "torch", "prefix": self.native.prefix,
            },
        }  # fmt: skip

    def lines(self) -> list[str]:
        out = [f"{self.verdict.upper()}: {self.headline}"]
        c = self.culprit()
        if c is not None:
            who = plural_ranks(c["ranks"]) if c["decided"] else \
                f"undecided (suspects: {rank_ranges(c['suspects'])})"  # fmt: skip
            out.append(f"  culprit: {who} | group {c['group']} | {c['collective']}")
        n = self.native
        out.append(f"\nFlight Recorder dumps ({n.prefix}<rank>, torch's format; no lifecycle traces)")
        out.append(f"  {plural_ranks(sorted(n.dumps))} in {self.folder}")
        if self.missing:
            out.append(f"  no dump from {plural_ranks(list(self.missing))}")
        out.append("\nProcess groups (aligned by torch's Flight Recorder analyzer, as torchfrtrace does)")
        for g in self.groups.groups:
            out.extend(_group_lines(g))
        return out

    def render(self, out: TextIO) -> None:
        out.write("\n".join(self.lines()) + "\n")


def _group_lines(g: GroupVerdict) -> list[str]:
    later = f" (and {g.later} later collective(s) of it unmatched, its consequences)" if g.later else ""
    return [f"  {g.label}, {plural_ranks(list(g.members))}: {g.verdict}{later}",
            f"    now: {g.line}"]  # fmt: skip


def replay_dumps(folder: str | Path, *, prefix: str | None = None) -> FrOnlyReplay:
    """Read and align the torch-format dumps in ``folder``; ``FlightRecorderError`` on bad input.

    A folder of the lifecycle's own ``fr-rank-<r>.json`` dumps is read too (their ``fr`` is torch's dump).
    """
    native = None
    if prefix is None and Path(folder).is_dir() and not any(Path(folder).rglob(f"{DEFAULT_PREFIX}*")):
        native = _lifecycle_dumps(folder)
    if native is None:
        native = load_native_dir(folder, prefix)
    if not native.dumps:
        raise fr.FlightRecorderError(path=str(folder), reason=f"it holds no Flight Recorder dump ({native.prefix}"
                                     "<rank> or fr-rank-<r>.json); name their prefix with --fr-prefix")  # fmt: skip
    dumps = {r: fr.rank_dump(r, d, native.paths[r]) for r, d in native.dumps.items()}
    groups = analyse(native.dumps, str(folder))
    last = tuple(RankCollective(r, d.entries[-1], "(no trace)", None, None)
                 for r, d in sorted(dumps.items()) if d.entries)  # fmt: skip
    return FrOnlyReplay(str(folder), native, groups, last, _in_flight(dumps))


def _in_flight(dumps: dict[int, fr.RankDump]) -> tuple[RankCollective, ...]:
    out: list[RankCollective] = []
    for rank, d in sorted(dumps.items()):
        newest = {e.pg: e for e in d.entries}
        out.extend(RankCollective(rank, e, "(no trace)", None, None) for e in newest.values())
    return tuple(out)


def _lifecycle_dumps(folder: str | Path) -> NativeDumps | None:
    """The lifecycle's JSON dumps as native ones (their ``fr`` object, or a bare one's whole document, is torch's
    dump, its tuples as lists), each file read once."""
    found = fr.read_dir(folder)
    if not found:
        return None
    raw = {r: checked(d, str(path)) for r, (d, path) in found.items()}
    return NativeDumps("fr-rank-", raw, {r: path for r, (_, path) in found.items()})


def collectives(result: FrOnlyReplay) -> Sequence[CollectiveEntry]:
    """What ``export_perfetto`` draws for dumps alone: each rank's last collective on each group."""
    return [r.to_json() for r in result.in_flight]
