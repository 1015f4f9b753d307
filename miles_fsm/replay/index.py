"""The index beside a closed trace: the trace's fold, written once by its writer, read instead of the lines.

``Tracer.close()`` folds its own file (``miles_fsm.replay.read``) and
writes the result to ``rank-<r>.jsonl.index``, with the trace's size and
CRC-32 and a fingerprint of the reader that folded it. Replay uses an
index only while all of it still holds: same size, same CRC (so a trace
cut, appended to, shuffled or flipped in place after close is read from its
lines, and its damage reported as ever), same reader code, same rank, and
no ``--epoch`` or ``--run`` filter (the index is the unfiltered fold).
Anything else (no index, another version, an unreadable or damaged index)
folds the lines: the trace is the truth, the index only saves reading it,
so a rank that crashed or hung before close is read as before.

The CRC guards against accidents (a copy cut short, an edit, a flipped
bit), not against an adversary: whoever can rewrite a trace can rewrite its
index too. It runs at several GB/s; SHA-256 would cost several times as
much, most of an indexed replay.

The index is msgpack (msgspec): plain data, decoded without running code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import zlib
from array import array
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from miles_fsm.replay.files import kind_of, open_regular, read_capped
from miles_fsm.replay.model import (
    BadLine,
    Damage,
    Duplicate,
    Illegal,
    MachineTable,
    Note,
    Position,
    RankTrace,
    TraceDirError,
)
from miles_fsm.trace.paths import index_path

__all__ = ["IndexCheck", "check_index", "load_index", "write_index"]

_FORMAT = 1
#: An index larger than this many times its trace, plus the slack, is none: a fold is smaller than its lines.
_MAX_INDEX_OVER = 2
_MAX_INDEX_SLACK = 1 << 20
_ARRAYS = ("epochs", "sigs", "guards", "work_s")
_RECORDS: dict[str, type] = {"duplicates": Duplicate, "bad": BadLine, "damaged": Damage, "notes": Note,
                             "illegal": Illegal}  # fmt: skip
_OPTIONAL: dict[str, type] = {"truncated": BadLine, "open": Position}
# The modules whose code decides what a fold holds: an index folded by other code is not used.


class _Index(msgspec.Struct, forbid_unknown_fields=True):
    format: int
    reader: str
    rank: int
    size: int
    crc32: int
    trace: dict[str, Any]


_decode = msgspec.msgpack.Decoder(_Index).decode
_encode = msgspec.msgpack.Encoder().encode


def write_index(trace: str | os.PathLike[str], rank: int) -> Path:
    """Fold the (closed) trace and write its index beside it, atomically; returns the index's path.

    Raises ``TraceDirError`` when the trace cannot be read and ``OSError``
    when the index cannot be written (no partial index is left behind).
    """
    from miles_fsm.replay.read import read_rank  # the reader imports this module

    trace = Path(trace)
    size, crc = _checksum(trace)
    folded = read_rank(trace, rank, use_index=False)
    doc = _Index(format=_FORMAT, reader=_reader_fingerprint(), rank=rank, size=size, crc32=crc,
                 trace=_to_wire(folded))  # fmt: skip
    target = index_path(trace)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(_encode(doc))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


@dataclass(frozen=True, slots=True)
class IndexCheck:
    """What the index beside a trace says: its fold (None: no index that holds), and whether the trace changed."""

    fold: RankTrace | None = None
    #: Why the trace is not what its writer closed (its size or CRC-32 differ from the index's); None: not known to.
    changed: str | None = None


def load_index(trace: str | os.PathLike[str], rank: int) -> RankTrace | None:
    """The fold the index of ``trace`` holds, or None when there is none that still describes the trace."""
    return check_index(trace, rank).fold


def check_index(trace: str | os.PathLike[str], rank: int) -> IndexCheck:
    """The index of ``trace``: its fold while it describes the trace, and whether it proves the trace changed.

    Only an index of this format and this rank can prove a change (its size
    and CRC-32 are those of the trace at close, whatever reader folded it);
    any other index is as good as none.
    """
    trace = Path(trace)
    raw = _read(trace)
    if raw is None:
        return _NONE
    try:
        doc = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _NONE  # a damaged or foreign index is as good as none
    if doc.format != _FORMAT or doc.rank != rank:
        return _NONE
    try:
        size = trace.stat().st_size
        if size != doc.size:
            return IndexCheck(changed=f"changed after its writer closed it: {size} bytes now, {doc.size} at close "
                                     f"(its index says so)")  # fmt: skip
        if _checksum(trace) != (doc.size, doc.crc32):
            return IndexCheck(changed=f"changed after its writer closed it: the same {size} bytes, another CRC-32 "
                                      "than at close (its index says so)")  # fmt: skip
    except OSError:
        return _NONE  # the fold of the lines reports an unreadable trace properly
    if doc.reader != _reader_fingerprint():
        return _NONE  # folded by other code: the lines are read by this one
    try:
        return IndexCheck(fold=_from_wire(doc.trace, str(trace)))
    except (KeyError, TypeError, ValueError):
        return _NONE  # written by this reader, so never expected; the lines still say it all


_NONE = IndexCheck()


def _read(trace: Path) -> bytes | None:
    """The index's bytes, or None where there is none worth reading (none, unreadable, larger than any index of
    that trace: the lines are read instead, which is never wrong). One that is not a regular file (a FIFO would
    block the reader) is refused as a trace would be: ``TraceDirError``."""
    path = index_path(trace)
    try:
        mode, size = (st := os.stat(path)).st_mode, st.st_size
        limit = _MAX_INDEX_OVER * os.stat(trace).st_size + _MAX_INDEX_SLACK
    except OSError:
        return None
    if not stat.S_ISREG(mode):
        raise TraceDirError(path, f"is {kind_of(mode)}, not a regular file; replay reads only regular files")
    if size > limit:
        return None
    try:
        return read_capped(path, limit, "the index of a trace that size")
    except OSError:
        return None


@cache
def _reader_fingerprint() -> str:
    """SHA-256 of the reader's source files: every module of the replay package and of the trace
    package (its schema), found by listing them, so a module added or renamed is never left out;
    the package version where they cannot be read."""
    h = hashlib.sha256()
    try:
        for package in ("miles_fsm.replay", "miles_fsm.trace"):
            spec = importlib.util.find_spec(package)
            folders = list(spec.submodule_search_locations or ()) if spec is not None else []
            if not folders:
                raise OSError(f"{package} has no folder to read")
            for source in sorted(Path(folders[0]).glob("*.py")):
                h.update(source.name.encode() + b"\0" + source.read_bytes())
    except OSError:
        from miles_fsm import __version__

        return f"version:{__version__}"
    return h.hexdigest()


def _checksum(path: Path) -> tuple[int, int]:
    """The file's size and CRC-32, read in 1 MiB blocks."""
    size = crc = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(open_regular(path), "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _to_wire(t: RankTrace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(RankTrace):
        v = getattr(t, f.name)
        if f.name in _ARRAYS:
            v = [v.typecode, v.itemsize, v.tobytes()]
        elif f.name == "outcome":
            v = bytes(v)
        elif f.name in _RECORDS:
            v = [_record(x) for x in v]
        elif f.name in _OPTIONAL:
            v = None if v is None else _record(v)
        elif f.name == "runs":
            v = list(v.items())  # a run may be None, which msgpack keys need not support
        elif f.name == "table":
            v = None if v is None else _table(v)
        elif f.name == "sig_table":
            v = [[trig, src, dest, list(steps)] for trig, src, dest, steps in v]
        elif f.name == "guard_table":
            v = _columns(v)
        out[f.name] = v
    return out


def _from_wire(w: dict[str, Any], path: str) -> RankTrace:
    kw: dict[str, Any] = {}
    for f in fields(RankTrace):
        v = w[f.name]
        if f.name in _ARRAYS:
            typecode, itemsize, data = v
            a = array(typecode)
            if a.itemsize != itemsize:
                raise ValueError("written where a C long has another size")
            a.frombytes(data)
            v = a
        elif f.name == "outcome":
            v = bytearray(v)
        elif f.name in _RECORDS:
            v = [_RECORDS[f.name](**x) for x in v]
        elif f.name in _OPTIONAL:
            v = None if v is None else _OPTIONAL[f.name](**v)
        elif f.name == "runs":
            v = {run: n for run, n in v}
        elif f.name == "table":
            v = None if v is None else _machine_table(v)
        elif f.name == "sig_table":
            v = [(trig, src, dest, tuple(steps)) for trig, src, dest, steps in v]
        elif f.name == "guard_table":
            v = _rows(v)
        kw[f.name] = v
    kw["path"] = path  # where the trace is now, not where its writer had it
    t = RankTrace(**kw)
    if t.bad or t.truncated is not None or t.damaged:
        t.bad = [_moved(b, path) for b in t.bad]
        t.truncated = None if t.truncated is None else _moved(t.truncated, path)
        t.damaged = [Damage(path=path, line=d.line, records=d.records, reason=d.reason) for d in t.damaged]
    return t


def _table(t: MachineTable) -> list[Any]:
    arrows = [[src, trig, dest, list(steps)] for (src, trig), (dest, steps) in t.arrows.items()]
    return [t.initial, t.failed, sorted(t.cycle_states), arrows]


def _machine_table(w: list[Any]) -> MachineTable:
    initial, failed, cycle_states, arrows = w
    return MachineTable(initial=initial, failed=failed, cycle_states=frozenset(cycle_states),
                        arrows={(src, trig): (dest, tuple(steps)) for src, trig, dest, steps in arrows})  # fmt: skip


def _columns(table: list[tuple[Any, ...]]) -> list[Any]:
    """The guard table by column, collectives and tensor sets each stored once: a key is new at every guard,
    the plan and the tensor set hardly ever, and a row of tuples costs most of an index's decode."""
    keys, cols, tensors = zip(*table, strict=True) if table else ((), (), ())
    plans = list(dict.fromkeys(cols))
    sets = list(dict.fromkeys(tensors))
    plan_of, set_of = {p: i for i, p in enumerate(plans)}, {t: i for i, t in enumerate(sets)}
    return [list(keys), [list(p) for p in plans], [plan_of[p] for p in cols], sets, [set_of[t] for t in tensors]]


def _rows(columns: list[Any]) -> list[tuple[Any, ...]]:
    keys, plans, plan_ids, sets, set_ids = columns
    plan_rows = [tuple(p) for p in plans]
    return list(zip(keys, map(plan_rows.__getitem__, plan_ids), map(sets.__getitem__, set_ids), strict=True))


def _record(x: Any) -> dict[str, Any]:
    return {f.name: getattr(x, f.name) for f in fields(x)}


def _moved(b: BadLine, path: str) -> BadLine:
    return BadLine(path=path, line=b.line, reason=b.reason, text=b.text)
