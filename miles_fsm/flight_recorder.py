"""PyTorch's Flight Recorder: turn it on, read this rank's collectives, dump and load them.

The Flight Recorder (FR) keeps a ring buffer of every collective a process
issued, on gloo (CPU) as on NCCL, when ``TORCH_FR_BUFFER_SIZE`` is set before
the first process group is made. On gloo ``state`` stays ``"scheduled"``;
``retired`` is what says a collective completed, so ``in_flight`` reads it.

The engine only reads and writes FR records: mapping them to a lifecycle's
steps is the plan audit's (``miles_fsm.states.audit``) and replay's job.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.errors import MilesFsmError

__all__ = [
    "DEFAULT_BUFFER",
    "FR_ENV",
    "FlightRecorderError",
    "FrEntry",
    "NATIVE_PREFIX",
    "RankDump",
    "dump",
    "enable",
    "enabled",
    "entries",
    "load_dir",
    "load_file",
    "parse",
    "position",
    "rank_dump",
    "read_dir",
    "read_file",
]

#: The variable that turns the recorder on; read by torch when the first process group is made.
FR_ENV = "TORCH_FR_BUFFER_SIZE"
#: Entries kept: enough for a transition's collectives and the train step's, small enough to read fast.
DEFAULT_BUFFER = 200
_DUMP_GLOB = "fr-rank-*.json"
#: torch's own dump file prefix (``TORCH_FR_DUMP_TEMP_FILE``'s default name), which ``torchfrtrace`` reads.
NATIVE_PREFIX = "nccl_trace_rank_"


class FlightRecorderError(MilesFsmError, ValueError):
    """A Flight Recorder dump could not be read."""

    def __init__(self, *, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read the Flight Recorder dump {path}: {reason}. Pass the folder of the dumps "
                         "the run wrote (fr-rank-<r>.json, or torch's own <prefix><rank>)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class FrEntry:
    """One collective as the recorder saw it."""

    record_id: int
    seq: int  # collective_seq_id: the n-th collective of its process group
    op: str  # "all_gather", "all_reduce", ... (the backend prefix dropped)
    pg: str  # the process group's name
    pg_desc: str
    numel: int  # elements of the largest input
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    dtype: str | None
    retired: bool  # completed (gloo: the work finished)
    time_ns: int
    is_p2p: bool

    @property
    def size(self) -> int:
        """Elements of the largest input or output (an all-gather's declared size is its output's)."""
        return max([self.numel, *(_prod(s) for s in self.output_sizes)])

    def __str__(self) -> str:
        return f"{self.op} #{self.seq} on pg {self.pg_desc or self.pg} [{self.numel}]"


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump: its entries, oldest first."""

    rank: int
    entries: tuple[FrEntry, ...]
    path: str

    def last(self, *, skip_pgs: Iterable[str] = ()) -> FrEntry | None:
        """The newest collective outside ``skip_pgs`` (the guard's own group)."""
        skip = set(skip_pgs)
        return next((e for e in reversed(self.entries) if e.pg not in skip), None)


def enable(buffer: int = DEFAULT_BUFFER) -> None:
    """Turn the recorder on for process groups made after this call (before ``init_process_group``)."""
    os.environ.setdefault(FR_ENV, str(buffer))


def enabled() -> bool:
    try:
        return int(os.environ.get(FR_ENV, "0") or 0) > 0
    except ValueError:
        return False


def _raw() -> dict[str, Any]:
    import torch

    # The pickled dump without stack traces: several times cheaper than the JSON one, and it is
    # this process's own (trusted) data. The audit reads it once per audited transition.
    # torch's stubs (torch/_C/_distributed_c10d.pyi) leave _dump_fr_trace out; it returns the pickle's bytes.
    raw = torch._C._distributed_c10d._dump_fr_trace(True, False, False)  # type: ignore[attr-defined]
    dump: dict[str, Any] = pickle.loads(raw)
    return dump


def parse(entry: dict[str, Any]) -> FrEntry:
    """One raw FR entry (a dict of ``_dump_fr_trace_json``) as an ``FrEntry``."""
    name = str(entry.get("profiling_name", ""))
    inputs = tuple(tuple(_whole(d) for d in s) for s in entry.get("input_sizes") or ())
    outputs = tuple(tuple(_whole(d) for d in s) for s in entry.get("output_sizes") or ())
    pg = entry.get("process_group") or ["", ""]
    dtypes = entry.get("input_dtypes") or ()
    return FrEntry(
        record_id=_whole(entry.get("record_id", -1)),
        seq=_whole(entry.get("collective_seq_id", -1)),
        op=name.split(":", 1)[-1],
        pg=str(pg[0]),
        pg_desc=str(pg[1]) if len(pg) > 1 else "",
        numel=max((_prod(s) for s in inputs), default=0),
        input_sizes=inputs,
        output_sizes=outputs,
        dtype=str(dtypes[0]) if dtypes else None,
        retired=bool(entry.get("retired", False)),
        time_ns=_whole(entry.get("time_created_ns", 0)),
        is_p2p=bool(entry.get("is_p2p", False)),
    )


def _whole(v: Any) -> int:
    """``int(v)`` when it fits 64 bits (torch's int64 and uint64 fields); ``ValueError`` otherwise."""
    n = int(v)
    if not -(1 << 63) <= n < 1 << 64:
        raise ValueError(f"a number of {n.bit_length()} bits where a dump holds 64")
    return n


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def entries(after: int = -1, *, since_ns: int = 0) -> tuple[FrEntry, ...]:
    """This process's recorded collectives with ``record_id > after`` made at or after ``since_ns``, oldest first."""
    if not enabled():
        return ()
    raw = _raw().get("entries") or ()
    return tuple(parse(e) for e in raw if e.get("record_id", -1) > after and e.get("time_created_ns", 0) >= since_ns)


def position() -> int:
    """The newest record id (-1: none yet): a step boundary for ``entries(after=...)``."""
    recorded = entries()
    return recorded[-1].record_id if recorded else -1


def dump(directory: Path | str, rank: int, **meta: Any) -> Path | None:
    """Write this process's recorder to ``directory/fr-rank-<rank>.json``; None when it is off.

    ``meta`` (the trigger, epoch and step in flight, the guard's group) goes
    beside the raw dump, so replay can name what the rank was doing. The
    same dump goes to ``directory/nccl_trace_rank_<rank>`` in torch's own
    format, which ``torchfrtrace DIR`` reads.
    """
    if not enabled():
        return None
    raw = _raw()
    path = Path(directory) / f"fr-rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, orjson.dumps({"rank": rank, "meta": meta, "fr": raw}, default=str))
    _write(path.with_name(f"{NATIVE_PREFIX}{rank}"), pickle.dumps(_named_groups(raw)))
    return path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _named_groups(raw: dict[str, Any]) -> dict[str, Any]:
    """The dump with ``pg_config`` naming this rank's groups and their members, as torch's analyzer needs.

    gloo leaves it one entry keyed ``''`` with no ranks, and ``torchfrtrace`` then stops with ``KeyError``;
    the live process knows its groups, so they are written in.
    """
    from torch.distributed import distributed_c10d as c10d

    config = {k: v for k, v in (raw.get("pg_config") or {}).items() if k and v.get("ranks") != "[]"}
    if c10d.is_initialized():
        for pg, name in c10d._world.pg_names.items():
            ranks = sorted(c10d._world.pg_group_ranks.get(pg, {}))
            config.setdefault(str(name), {"name": str(name), "desc": str(pg.group_desc), "ranks": str(ranks)})
    return {**raw, "pg_config": config}


def load_file(path: Path | str) -> RankDump:
    """One dump written by ``dump`` (or a bare ``_dump_fr_trace_json``, with the rank from its name)."""
    rank, raw = read_file(path)
    return rank_dump(rank, raw, path)


def read_file(path: Path | str) -> tuple[int, Any]:
    """The rank of one JSON dump and torch's dump in it (its ``fr``, or the bare document), entries unread.

    Read as replay reads every file (``miles_fsm.replay.files``): a regular file, up to a cap, nested no
    deeper and holding no more than any dump (``miles_fsm.replay.fr_budget``).
    """
    from miles_fsm.replay.files import beyond, looks_like_a_rank, rank_number
    from miles_fsm.replay.fr_native import show

    p = Path(path)
    stem = p.name[len("fr-rank-") : -len(".json")] if p.name.startswith("fr-rank-") and p.name.endswith(".json") else ""
    if looks_like_a_rank(stem):
        raise FlightRecorderError(path=str(p), reason="not a dump's name: <r> of fr-rank-<r>.json is a rank in ASCII "
                                  "digits without leading zeros; rename or remove it")  # fmt: skip
    doc = _read_json(p)
    if not isinstance(doc, dict):
        raise FlightRecorderError(path=str(p), reason="not a JSON object")
    rank = doc.get("rank")
    if rank is None:
        rank = rank_number(stem)
        if rank is None:
            raise FlightRecorderError(path=str(p), reason="no rank in the file or its name (fr-rank-<r>.json)")
    if rank.__class__ is not int or rank < 0:
        raise FlightRecorderError(path=str(p), reason=f"its 'rank' is {show(rank)}, not a whole number")
    why = beyond(rank)
    if why is not None:
        raise FlightRecorderError(path=str(p), reason=why)
    return rank, doc.get("fr", doc)


def _read_json(p: Path) -> Any:
    from miles_fsm.replay.fr_budget import bounded
    from miles_fsm.replay.fr_native import read_dump_bytes

    try:
        return bounded(orjson.loads(read_dump_bytes(p)), str(p))
    except orjson.JSONDecodeError as exc:
        raise FlightRecorderError(path=str(p), reason=f"not JSON ({str(exc)[:80]})") from None


def rank_dump(rank: int, raw: Any, path: Path | str) -> RankDump:
    """torch's dump of one rank (``_dump_fr_trace``'s dict, pickled or JSON) as a ``RankDump``."""
    entries = raw.get("entries") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise FlightRecorderError(path=str(path), reason="no 'entries' list")
    try:
        parsed = tuple(parse(e) for e in entries)
    except (TypeError, ValueError, AttributeError) as exc:
        raise FlightRecorderError(path=str(path), reason=f"a malformed entry ({exc})") from None
    return RankDump(rank=rank, entries=parsed, path=str(path))


def read_dir(directory: Path | str) -> dict[int, tuple[Any, Path]]:
    """torch's dump in every ``fr-rank-<r>.json`` under ``directory`` (searched recursively) and its file, by rank."""
    d = Path(directory)
    if not d.is_dir():
        raise FlightRecorderError(path=str(d), reason="not a directory")
    found = {}
    for path in sorted(d.rglob(_DUMP_GLOB)):
        rank, raw = read_file(path)
        found[rank] = (raw, path)
    return found


def load_dir(directory: Path | str) -> dict[int, RankDump]:
    """Every ``fr-rank-<r>.json`` under ``directory`` (searched recursively), by rank."""
    return {rank: rank_dump(rank, raw, path) for rank, (raw, path) in read_dir(directory).items()}


def dump_meta(path: Path | str) -> dict[str, Any]:
    """The ``meta`` that ``dump`` wrote beside the entries ({} when none)."""
    try:
        doc = _read_json(Path(path))
    except FlightRecorderError:
        return {}
    meta = doc.get("meta") if isinstance(doc, dict) else None
    plain = (str, int, float, bool, type(None))
    return {k: v for k, v in meta.items() if v.__class__ in plain} if isinstance(meta, dict) else {}
