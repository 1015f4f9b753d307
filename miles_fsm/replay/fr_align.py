"""Each rank's last collective in its Flight Recorder dump, placed in the lifecycle step it was issued in.

A hang in a collective leaves every rank's trace at "inside a step"; the
recorder says *which* collective each rank was in (its process group's
sequence number, op and sizes). Placing that collective's creation time in
the rank's trace names the step that issued it, so ranks that wait in
different collectives of the same group are told in one line, e.g.
"ranks 0-6 in all_gather #39 during sync/param_sync (epoch 5); ranks 7-9
in reduce_scatter #39 during train (epoch 5)".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from miles_fsm import flight_recorder as fr
from miles_fsm.ranks import rank_ranges
from miles_fsm.replay.checks import invalid
from miles_fsm.replay.files import OVERSIZED, iter_lines
from miles_fsm.replay.fr_groups import FrGroups, analyse
from miles_fsm.replay.fr_native import load_native_dir, show
from miles_fsm.replay.shapes import CollectiveEntry, FlightRecorderReport

__all__ = ["FrReport", "RankCollective", "align", "explain"]


@dataclass(frozen=True, slots=True)
class RankCollective:
    """Where one rank's last collective was issued."""

    rank: int
    entry: fr.FrEntry
    where: str  # "sync/param_sync", "train", "guard of resume", ...
    epoch: int | None
    declared: bool | None  # whether the step's guarded plan listed its op (None: no plan traced)

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.entry.op, self.entry.seq, self.entry.pg_desc or self.entry.pg, self.where, self.epoch)

    def to_json(self) -> CollectiveEntry:
        e = self.entry
        return {"rank": self.rank, "op": e.op, "collective_seq_id": e.seq, "process_group": e.pg_desc or e.pg,
                "input_sizes": [list(s) for s in e.input_sizes], "output_sizes": [list(s) for s in e.output_sizes],
                "time_ns": e.time_ns, "where": self.where, "epoch": self.epoch, "declared": self.declared}  # fmt: skip


@dataclass(frozen=True, slots=True)
class FrReport:
    """What the dumps say: each rank's last collective, and the one-line summary."""

    ranks: tuple[RankCollective, ...]
    missing: tuple[int, ...]
    problems: tuple[str, ...]
    #: Each process group as torch's analyzer aligns it (``fr_groups``); None: not analysed.
    groups: FrGroups | None = None

    @property
    def mismatch(self) -> bool:
        """True when the ranks were last in different collectives (or some issued one the plan lacked),
        or torch's analyzer found a group out of step."""
        return len({r.key[:3] for r in self.ranks}) > 1 or any(r.declared is False for r in self.ranks) \
            or bool(self.groups and self.groups.problems)  # fmt: skip

    @property
    def line(self) -> str:
        groups: dict[tuple[Any, ...], list[RankCollective]] = {}
        for r in sorted(self.ranks, key=lambda r: r.rank):
            groups.setdefault(r.key, []).append(r)
        parts = []
        for members in groups.values():
            r = members[0]
            who = "rank" if len(members) == 1 else "ranks"
            epoch = f" (epoch {r.epoch})" if r.epoch is not None else ""
            flag = ", not in its plan" if r.declared is False else ""
            parts.append(f"{who} {rank_ranges([m.rank for m in members])} in {r.entry.op} #{r.entry.seq} on "
                         f"{r.entry.pg_desc or r.entry.pg} during {r.where}{epoch}{flag}")  # fmt: skip
        if self.missing:
            parts.append(f"no dump from rank(s) {rank_ranges(list(self.missing))}")
        return "; ".join(parts) if parts else "no collective recorded"

    def to_json(self) -> FlightRecorderReport:
        return {"line": self.line, "mismatch": self.mismatch, "ranks": [r.to_json() for r in self.ranks],
                "missing": list(self.missing), "problems": list(self.problems),
                "groups": None if self.groups is None else self.groups.to_json()}  # fmt: skip


def _records(path: Path, run: str | None) -> Iterator[dict[str, Any]]:
    """The trace's records (of ``run``), read as the fold reads them: in blocks, a line over 16 MiB never read."""
    for _, line, _complete in iter_lines(path):
        if line is OVERSIZED:
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn or damaged line: replay's own reader reports it
        if rec.__class__ is dict and invalid(rec) is None and (run is None or rec.get("run") == run):
            yield rec


def _place(records: Iterable[dict[str, Any]], t_ns: int) -> tuple[str, int | None, list[str] | None]:
    """The step a collective created at wall time ``t_ns`` was issued in, its epoch, and the collectives its
    step's guarded plan declared (None: no plan traced)."""
    where: str = "start"
    epoch: int | None = None
    planned: list[str] | None = None
    plans: dict[str, list[str]] = {}
    for rec in records:
        wall = rec.get("wall")
        if wall.__class__ in (int, float) and wall * 1e9 > t_ns:
            break
        event, trigger = rec.get("event"), rec.get("trigger")
        if event == "guard_entered":
            cols = rec.get("collectives")
            plans[str(trigger)] = [str(c).split("@", 1)[0] for c in cols] if cols.__class__ is list else []
            where, epoch, planned = f"guard of {trigger}", rec.get("epoch"), None
        elif event == "guard_passed":
            where, epoch, planned = str(trigger), rec.get("epoch"), plans.get(str(trigger))
        elif event == "action_started":
            where, epoch = f"{trigger}/{rec.get('action')}", rec.get("epoch")
            planned = plans.get(str(trigger), [])
        elif event in ("action_finished", "transition_finished"):
            where, planned = f"after {trigger}/{rec.get('action') or ''}".rstrip("/"), None
    return where, epoch, planned


_REDUCE_SCATTER_AS = {"all_reduce", "reduce_scatter"}


def align(traces: Mapping[int, Path], dumps: Mapping[int, fr.RankDump], *, run: str | None = None,
          native: bool = False) -> FrReport:
    """Each dumped rank's last collective outside the guard's group, placed in its trace.

    ``native``: the dumps are torch's own pickles, which carry no ``meta`` (run, guard's group) to read.
    """
    placed, problems = [], []
    for rank, dump in sorted(dumps.items()):
        meta = {} if native else fr.dump_meta(dump.path)
        if run is not None and meta.get("run") not in (None, run):
            problems.append(f"rank {rank}: {dump.path} is of run {show(meta['run'])}, not {run}: left out")
            continue
        guard_pg = meta.get("guard_pg")
        last = dump.last(skip_pgs=[guard_pg] if guard_pg else [])
        if last is None:
            problems.append(f"rank {rank}: its dump holds no collective outside the guard's group")
            continue
        path = traces.get(rank)
        where, epoch, plan = _place(_records(path, run), last.time_ns) if path else ("(no trace)", None, None)
        ops = set(plan) if plan is not None else None
        if ops is not None and "reduce_scatter" in ops:
            ops |= _REDUCE_SCATTER_AS  # gloo records a reduce-scatter as an all-reduce
        declared = None if ops is None else last.op in ops
        placed.append(RankCollective(rank, last, where, epoch, declared))
    missing = tuple(sorted(set(traces) - {r.rank for r in placed}))
    return FrReport(tuple(placed), missing, tuple(problems))


def explain(traces: Mapping[int, Path], fr_dir: Path | str | None, *, run: str | None = None,
            prefix: str | None = None) -> FrReport | None:
    """The report from the dumps in ``fr_dir`` (None: beside the traces); None when there are none.

    ``fr_dir`` may hold torch's own dumps (``<prefix><rank>``, ``fr_native``) instead of the lifecycle's.
    Raises ``FlightRecorderError`` for a ``fr_dir`` that cannot be read, or a corrupt dump in it.
    """
    if fr_dir is None:
        folders = {p.parent for p in traces.values()}
        found = {}
        problems = []
        for folder in folders:
            for path in sorted(folder.glob("fr-rank-*.json")):
                try:
                    d = fr.load_file(path)
                except fr.FlightRecorderError as exc:
                    problems.append(str(exc))  # beside the traces and unreadable: noted, not fatal
                    continue
                found[d.rank] = d
        if not found and not problems:
            return None
        report = align(traces, found, run=run)
        return FrReport(report.ranks, report.missing, (*report.problems, *problems))
    dumps = fr.load_dir(fr_dir) if prefix is None else {}
    if dumps:
        return align(traces, dumps, run=run)
    native = load_native_dir(fr_dir, prefix)
    if not native.dumps:
        raise fr.FlightRecorderError(path=str(fr_dir), reason=f"it holds no Flight Recorder dump (fr-rank-<r>.json "
                                     f"or {native.prefix}<rank>)")  # fmt: skip
    dumps = {r: fr.rank_dump(r, d, native.paths[r]) for r, d in native.dumps.items()}
    report = align(traces, dumps, run=run, native=True)
    return FrReport(report.ranks, report.missing, report.problems, analyse(native.dumps, str(fr_dir)))
