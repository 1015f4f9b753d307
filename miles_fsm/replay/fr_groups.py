"""Each process group's collectives aligned across ranks by torch's own analyzer, and what went wrong.

``torchfrtrace`` (``torch.distributed.flight_recorder.fr_trace``) matches
each group's collectives across its ranks by sequence id and reports the
first that does not match: ranks missing from it ("Not all ranks joining
collective"), or a rank whose op, sizes, dtypes or state differ. Replay runs
the same code (``components.builder.build_db``) on the dumps, ``normalise``d
so gloo's are read as they are, so the two can only agree; torch is imported
here only when dumps are analysed.

On top of torch's verdict, each group says where its ranks are now (their
last collective on it), the one line a person wants for a hang: "2 ranks
(0-1) in all_gather #39, 1 rank (2) in all_reduce #39 on the same group dp".
"""

from __future__ import annotations

import argparse
import ast
import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles_fsm import flight_recorder as fr
from miles_fsm.ranks import rank_ranges
from miles_fsm.replay.fr_native import normalise
from miles_fsm.replay.shapes import FrGroup

__all__ = ["NOT_ALL_JOINING", "UNDECIDED", "FrGroups", "GroupVerdict", "Part", "analyse"]

#: torch's "Not all ranks joining collective" (its other kinds are ``MatchState`` names).
NOT_ALL_JOINING = "NOT_ALL_RANKS_JOINING"
#: torch's "We cannot decide what's wrong with this collective entry": a member left no dump.
UNDECIDED = "UNDECIDED_MISSING_DUMPS"


@dataclass(frozen=True, slots=True)
class Part:
    """Ranks whose last collective on a group is the same one (op, sequence id and sizes)."""

    ranks: tuple[int, ...]
    op: str
    seq: int
    input_sizes: tuple[tuple[int, ...], ...]

    def text(self, sizes: bool) -> str:
        n = len(self.ranks)
        shown = f" {', '.join(str(list(s)) for s in self.input_sizes)}" if sizes else ""
        return f"{n} rank{'s' if n > 1 else ''} ({rank_ranges(self.ranks)}) in {self.op} #{self.seq}{shown}"


@dataclass(frozen=True, slots=True)
class GroupVerdict:
    """One process group: where its ranks are, and torch's verdict on its first unmatched collective."""

    name: str
    desc: str
    members: tuple[int, ...]
    parts: tuple[Part, ...]
    idle: tuple[int, ...]  # members whose dump holds no collective of the group
    kind: str | None  # None: torch matched every collective
    op: str | None  # torch's collective (as its reference rank recorded it)
    seq: int | None
    culprits: tuple[int, ...]  # ranks whose collective differs from the reference rank's
    missing: tuple[int, ...]  # ranks not in the collective ("Not all ranks joining")
    detail: str
    later: int  # unmatched collectives of the group after the first (its consequences)

    @property
    def label(self) -> str:
        if self.desc in ("", "undefined"):  # torch's desc for a group made without group_desc
            return f"pg {self.name}"
        return self.desc if self.name == self.desc else f"{self.desc} (pg {self.name})"

    @property
    def line(self) -> str:
        """``2 ranks (0-1) in all_gather #39, 1 rank (2) in all_reduce #39 on the same group dp (pg 3)``."""
        same_call = len({(p.op, p.seq) for p in self.parts}) < len(self.parts)
        text = ", ".join(p.text(same_call) for p in self.parts)
        if self.idle:
            text += f"{', ' if text else ''}{len(self.idle)} with none recorded ({rank_ranges(self.idle)})"
        where = "the same group" if len(self.parts) + bool(self.idle) > 1 else "group"
        return f"{text} on {where} {self.label}"

    @property
    def blamed(self) -> tuple[tuple[int, ...], bool]:
        """Replay's culprit: the smaller side of torch's split (decided), or both sides when they are as large.

        torch names the ranks that differ from its reference rank (the first it read), or those missing
        from a collective; either side may be the odd one: a rank that issued a collective no peer did
        leaves every peer "missing".
        """
        if self.kind is None or self.kind == UNDECIDED:
            return (), False
        odd = self.missing if self.kind == NOT_ALL_JOINING else self.culprits
        rest = tuple(r for r in self.members if r not in odd)
        if len(odd) == len(rest):
            return tuple(sorted((*odd, *rest))), False
        return (odd if len(odd) < len(rest) else rest), True

    @property
    def verdict(self) -> str:
        """torch's verdict in words, ``ok`` when it matched every collective."""
        if self.kind is None:
            return "ok: every collective matched on all its ranks"
        at = f"{self.op} #{self.seq}"
        if self.kind == NOT_ALL_JOINING:
            return f"{NOT_ALL_JOINING} at {at}: missing {rank_ranges(self.missing)}"
        if self.kind == UNDECIDED:
            return f"{UNDECIDED} at {at}: {self.detail}"
        return f"{self.kind} at {at}: culprit {rank_ranges(self.culprits)} ({self.detail})"

    def to_json(self) -> FrGroup:
        return {"name": self.name, "desc": self.desc, "members": list(self.members), "line": self.line,
                "kind": self.kind, "op": self.op, "collective_seq_id": self.seq, "culprits": list(self.culprits),
                "missing": list(self.missing), "detail": self.detail, "later": self.later,
                "idle": list(self.idle), "parts": [{"ranks": list(p.ranks), "op": p.op, "collective_seq_id": p.seq,
                                                    "input_sizes": [list(s) for s in p.input_sizes]}
                                                   for p in self.parts]}  # fmt: skip


@dataclass(frozen=True, slots=True)
class FrGroups:
    """Every group of the dumps, and the ranks that dumped."""

    groups: tuple[GroupVerdict, ...]
    dumped: tuple[int, ...]

    @property
    def problems(self) -> tuple[GroupVerdict, ...]:
        """The groups torch left a collective of unmatched, undecided ones included."""
        return tuple(g for g in self.groups if g.kind is not None)

    @property
    def out_of_step(self) -> tuple[GroupVerdict, ...]:
        """The groups torch found out of step: each names its ranks' split, which an undecided one cannot."""
        return tuple(g for g in self.groups if g.kind not in (None, UNDECIDED))

    @property
    def undecided(self) -> tuple[GroupVerdict, ...]:
        """The groups torch cannot judge, a member having left no dump, with no collective seen out of step."""
        return tuple(g for g in self.groups if g.kind == UNDECIDED)

    @property
    def line(self) -> str:
        """The one-line summary: each group torch found out of step, else that all are in step."""
        bad = self.problems
        if not bad:
            return f"{len(self.groups)} process group(s) of {len(self.dumped)} rank(s): every collective matched"
        return "; ".join(g.line for g in bad)

    def to_json(self) -> list[FrGroup]:
        return [g.to_json() for g in self.groups]


def analyse(dumps: Mapping[int, Mapping[str, Any]], where: str) -> FrGroups:
    """Align every group's collectives with torch's analyzer (``FlightRecorderError`` if it cannot)."""
    normalised = normalise(dumps)
    db = _torch_db(normalised, where)
    matched = {c.collective_id for c in db.ncclcalls if c.collective_id is not None}
    failed: dict[str, list[Any]] = {}
    for c in db.collectives:
        if c.id not in matched and (c.missing_ranks or c.mismatch_collectives or _undecided(c, dumps)):
            failed.setdefault(str(c.group_id), []).append(c)
    members: dict[str, set[int]] = {}
    for d in normalised.values():
        for name, config in d["pg_config"].items():
            members.setdefault(str(name), set()).update(int(r) for r in ast.literal_eval(str(config["ranks"])))
    verdicts = [_verdict(name, members.get(name, set()), normalised, failed.get(name, []))
                for name in sorted(_names(normalised), key=_name_order)]  # fmt: skip
    return FrGroups(tuple(verdicts), tuple(sorted(dumps)))


def _names(dumps: Mapping[int, Mapping[str, Any]]) -> set[str]:
    return {str(e["process_group"][0]) for d in dumps.values() for e in d["entries"]}


def _name_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


def _undecided(c: Any, dumps: Mapping[int, Any]) -> bool:
    return bool(set(c.expected_ranks) - set(dumps))


def _torch_db(dumps: Mapping[int, Mapping[str, Any]], where: str) -> Any:
    """torch's ``build_db`` on the dumps, its own log lines silenced (replay reports what it returns)."""
    details = {str(r): {"host_name": f"host_rank{r}", "rank": r, "entries": copy.deepcopy(d["entries"]),
                        "version": d["version"], "pg_config": d["pg_config"]}
               for r, d in sorted(dumps.items())}  # fmt: skip
    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10)
    version = str(next(iter(details.values()))["version"]) if details else ""
    log = logging.getLogger("Flight Recorder")
    was = log.disabled
    log.disabled = True  # before the import too: without tabulate, torch's builder warns as it is imported
    try:
        from torch.distributed.flight_recorder.components.builder import build_db

        return build_db(details, args, version)
    except (AssertionError, KeyError, ValueError, TypeError, IndexError, SyntaxError) as exc:
        # torch's analyzer asserts on what it cannot align; the dumps, not replay, are what it objects to.
        raise fr.FlightRecorderError(path=where, reason=f"torch's Flight Recorder analyzer cannot align these dumps "
                                     f"({type(exc).__name__}: {exc})") from None  # fmt: skip
    finally:
        log.disabled = was


def _verdict(name: str, members: set[int], dumps: Mapping[int, Mapping[str, Any]], failed: list[Any]) -> GroupVerdict:
    last: dict[int, Mapping[str, Any]] = {}
    desc = ""
    for rank, d in sorted(dumps.items()):
        for e in d["entries"]:
            if str(e["process_group"][0]) == name:
                last[rank], desc = e, str(e["process_group"][1])
    parts: dict[tuple[Any, ...], list[int]] = {}
    for rank, e in sorted(last.items()):
        key = (fr.parse(dict(e)).op, int(e["collective_seq_id"]), tuple(tuple(s) for s in e["input_sizes"]))
        parts.setdefault(key, []).append(rank)
    shown = tuple(Part(tuple(r), op, seq, sizes) for (op, seq, sizes), r in parts.items())
    idle = tuple(sorted(members - set(last)))
    if not failed:
        return GroupVerdict(name, desc, tuple(sorted(members)), shown, idle, None, None, None, (), (), "", 0)
    c = failed[0]
    errors = sorted((int(r), m.type_of_mismatch) for r, m in (c.mismatch_collectives or {}).items())
    if c.missing_ranks:
        kind = NOT_ALL_JOINING
    elif errors:
        kind = ", ".join(sorted({str(info.state.name) for _, info in errors}))
    else:
        kind = UNDECIDED
    detail = ", ".join(f"Culprit rank {r}; {info}" for r, info in errors) if errors else (
        f"no dump from rank(s) {rank_ranges(set(c.expected_ranks) - set(dumps))}" if kind == UNDECIDED else "")
    return GroupVerdict(name, desc, tuple(sorted(members)), shown, idle, kind,
                        str(c.collective_name).split(":", 1)[-1], int(c.collective_seq_id),
                        tuple(r for r, _ in errors), tuple(sorted(c.missing_ranks or ())), detail,
                        len(failed) - 1)  # fmt: skip
