"""PyTorch's own Flight Recorder dumps (``<prefix><rank>`` pickles), read as untrusted input.

A job that hangs writes one pickle per rank, named ``<prefix><rank>``
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with ``TORCH_FR_DUMP_TEMP_FILE``, default
prefix ``nccl_trace_rank_``; or ``torch._C._distributed_c10d._dump_fr_trace``).
A pickle can run any code when it is loaded, so it is loaded here with an
unpickler that resolves no global at all beyond the TorchScript pickler's
typed-list helpers (turned into builtins, never imported): a dump is dicts,
lists, tuples, strings and numbers. Anything else is refused before it runs.

gloo's dumps name no group in ``pg_config`` (one entry keyed ``''``, with
ranks ``'[]'``), which stops torch's own analyzer with ``KeyError``.
``normalise`` fills it in from what the dumps do say: a group's members are
the ranks with an entry of it, the default group's every rank. A member
that issued nothing on a group (or whose entries of it left the ring
buffer) cannot be seen in gloo's dumps. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
import reprlib
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_fsm import flight_recorder as fr
from miles_fsm.replay.checks import MAX_RANKS
from miles_fsm.replay.files import beyond, kind_of, looks_like_a_rank, rank_number, read_capped
from miles_fsm.replay.fr_budget import MAX_DUMP_BYTES, bounded, scan
from miles_fsm.replay.model import TraceDirError

__all__ = [
    "DEFAULT_PREFIX",
    "NativeDumps",
    "UnsafeDumpError",
    "checked",
    "dump_files",
    "load_dump",
    "load_native_dir",
    "normalise",
]

#: torch's own default (``TORCH_FR_DUMP_TEMP_FILE`` is ``/tmp/nccl_trace_rank_``), on gloo as on NCCL.
DEFAULT_PREFIX = fr.NATIVE_PREFIX
#: What torch's analyzer (``fr_trace``) reads of each entry; a dump whose entries lack one is not a dump.
_ENTRY_KEYS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes",
               "output_sizes", "input_dtypes", "output_dtypes", "state", "time_created_ns", "is_p2p")  # fmt: skip
#: The TorchScript pickler writes typed lists and tagged containers through these; each is a plain value here.
_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.jit._pickle", "build_intlist"): list,
    ("torch.jit._pickle", "build_doublelist"): list,
    ("torch.jit._pickle", "build_boollist"): list,
    ("torch.jit._pickle", "restore_type_tag"): lambda value, _type: value,
}


class UnsafeDumpError(fr.FlightRecorderError):
    """A file named as a Flight Recorder dump holds a pickle that would run code when loaded: refused, unrun."""

    def __init__(self, *, path: str, name: str) -> None:
        self.name = name
        super().__init__(path=path, reason=f"it is a pickle that would call {name} when loaded, which no Flight "
                         "Recorder dump does; it was refused and nothing in it ran (is it really a dump?)")  # fmt: skip


class _Restricted(pickle.Unpickler):
    """An unpickler that builds only dicts, lists, tuples, strings, numbers, None and booleans."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        safe = _SAFE_GLOBALS.get((module, name))
        if safe is None:
            raise UnsafeDumpError(path=self.path, name=f"{module}.{name}")
        return safe

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDumpError(path=self.path, name=f"a persistent object ({str(pid)[:40]})")


def read_dump_bytes(path: Path | str) -> bytes:
    """A dump file's bytes: a regular file of at most ``MAX_DUMP_BYTES``, opened without blocking."""
    try:
        return read_capped(Path(path), MAX_DUMP_BYTES, "a Flight Recorder dump")
    except TraceDirError as exc:
        raise fr.FlightRecorderError(path=str(path), reason=exc.reason) from None
    except OSError as exc:
        raise fr.FlightRecorderError(path=str(path), reason=f"cannot read it ({exc.strerror or exc})") from None


def load_dump(path: Path | str) -> dict[str, Any]:
    """One rank's dump, checked to be one; ``FlightRecorderError`` (``UnsafeDumpError``, ``DumpBudgetError``)
    otherwise. Its opcodes are checked against the budget (``fr_budget``) before anything is built."""
    p = str(path)
    data = read_dump_bytes(path)
    scan(data, p)
    try:
        doc = _Restricted(data, p).load()
    except UnsafeDumpError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            OverflowError) as exc:  # fmt: skip
        # What a cut-off or foreign file makes the unpickler raise; the file is named, the job can go on.
        cut = isinstance(exc, EOFError) or "truncated" in str(exc)
        why = "it ends early (truncated)" if cut else f"not a pickle ({type(exc).__name__})"
        raise fr.FlightRecorderError(path=p, reason=f"{why}: {str(exc)[:80] or 'no detail'}") from None
    return checked(bounded(doc, p), p)


def checked(doc: Any, path: str) -> dict[str, Any]:
    """``doc`` if it is a dump: a dict with a version, a pg_config dict and entries torch's analyzer can read.

    Every field replay or torch's analyzer reads is checked for its type here, before it is used or shown,
    so a malformed dump is one error naming its file and field, not a traceback from deep inside either.
    ``doc`` must be ``bounded`` (``fr_budget``) first: the checks walk what it holds.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise fr.FlightRecorderError(path=path, reason="not a Flight Recorder dump (no 'entries' list)")
    if not isinstance(doc.get("version"), str) or not isinstance(doc.get("pg_config"), dict):
        raise fr.FlightRecorderError(path=path, reason="not a Flight Recorder dump (no 'version' string or "
                                     "'pg_config' dict)")  # fmt: skip
    _check_groups(doc["pg_config"], path)
    for i, e in enumerate(doc["entries"]):
        lacks = [k for k in _ENTRY_KEYS if not isinstance(e, dict) or k not in e]
        pg: Any = e.get("process_group") if isinstance(e, dict) else None
        name: Any = e.get("profiling_name") if isinstance(e, dict) else None
        if lacks or not _is_list(pg, _is_str) or len(pg) != 2 or name.__class__ is not str or ":" not in name:
            what = f"lacks {', '.join(lacks)}" if lacks else "has a malformed process_group or profiling_name"
            raise fr.FlightRecorderError(path=path, reason=f"entry {i} {what}: not a Flight Recorder dump this "
                                         "torch writes")  # fmt: skip
        for key, (ok, want) in _ENTRY_TYPES.items():
            if key in e and not ok(e[key]):
                raise fr.FlightRecorderError(path=path, reason=f"entry {i}'s {key} is {show(e[key])}, not {want}: "
                                             "not a Flight Recorder dump this torch writes")  # fmt: skip
    return doc


class _Shown(reprlib.Repr):
    """A value of a hostile file as a line may show it: a few items, a few levels, no huge number spelled out."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 40, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if -_BIG < x < _BIG else f"<an integer of {x.bit_length()} bits>"


_BIG = 10**40
show = _Shown().repr


def _is_int(v: Any) -> bool:
    """A whole number a dump may hold: 64 bits, signed or not (torch writes int64 and uint64)."""
    return v.__class__ is int and -(1 << 63) <= v < (1 << 64)


def _is_str(v: Any) -> bool:
    return v.__class__ is str


def _is_list(v: Any, each: Any) -> bool:
    return v.__class__ in (list, tuple) and all(each(x) for x in v)


def _is_shapes(v: Any) -> bool:
    return _is_list(v, lambda s: _is_list(s, _is_int))


def _is_strings(v: Any) -> bool:
    return _is_list(v, _is_str)


#: What each entry field must be (checked only when present: ``retired`` is newer than some dumps).
_ENTRY_TYPES: dict[str, tuple[Any, str]] = {
    **{k: (_is_int, "a whole number") for k in ("record_id", "collective_seq_id", "p2p_seq_id", "time_created_ns")},
    **{k: (_is_shapes, "a list of shapes such as [[4]]") for k in ("input_sizes", "output_sizes")},
    **{k: (_is_strings, "a list of dtype names") for k in ("input_dtypes", "output_dtypes")},
    "state": (_is_str, "a state name"),
    "is_p2p": (lambda v: v.__class__ is bool, "true or false"),
    "retired": (lambda v: v.__class__ is bool, "true or false"),
}


def _check_groups(config: dict[Any, Any], path: str) -> None:
    """Each group ``pg_config`` describes has a ``desc`` and ``ranks``, the text of a list of ranks.

    torch's analyzer ``eval``s ``ranks`` when ``ast.literal_eval`` makes a string of it: anything but a list
    of numbers must be refused before torch sees it, or a dump could run code.
    """
    for name, group in config.items():
        if not name or not isinstance(group, dict) or group.get("ranks") == "[]":
            continue  # gloo's placeholder or no group: ``normalise`` drops it, torch never reads it
        if not _is_str(name):
            raise fr.FlightRecorderError(path=path, reason=f"pg_config has a group named {show(name)}, not by a "
                                         "string: not a Flight Recorder dump this torch writes")  # fmt: skip
        lacks = [k for k in ("desc", "ranks") if k not in group]
        if lacks:
            raise fr.FlightRecorderError(path=path, reason=f"pg_config[{show(name)}] lacks {', '.join(lacks)}: not "
                                         "a Flight Recorder dump this torch writes")  # fmt: skip
        ranks = group["ranks"]
        parsed = _rank_list(ranks)
        if parsed is None:
            raise fr.FlightRecorderError(path=path, reason=f"pg_config[{show(name)}] ranks is {show(ranks)}, not the "
                                         f"text of a list of ranks below {MAX_RANKS} such as '[0, 1]'")  # fmt: skip


def _rank_list(ranks: Any) -> list[int] | None:
    """The ranks a group's ``ranks`` text lists (each below ``MAX_RANKS``), or None. Only the text of a list of
    numbers is parsed: torch's analyzer ``eval``s what ``ast.literal_eval`` cannot read."""
    if not _is_str(ranks) or len(ranks) > 8 * MAX_RANKS or not re.fullmatch(r"\[[0-9, ]*\]", ranks):
        return None
    try:
        parsed = ast.literal_eval(ranks)
    except (ValueError, SyntaxError):
        return None
    return parsed if _is_list(parsed, lambda r: r.__class__ is int and 0 <= r < MAX_RANKS) else None


def dump_files(directory: Path | str, prefix: str | None = None) -> tuple[str, dict[int, Path]]:
    """``(prefix, {rank: path})`` of the ``<prefix><rank>`` files in ``directory``.

    The folder's own files; when none is a dump, those of its subfolders (one per host, say).
    With no ``prefix``: torch's default when such files exist, else the one common prefix of the files
    whose names end in a number, inferred by torch's own rule (``fr_trace --prefix`` not given).
    """
    d = Path(directory)
    if not d.is_dir():
        raise fr.FlightRecorderError(path=str(d), reason="not a directory")
    found: tuple[str, dict[int, Path]] = (prefix or DEFAULT_PREFIX, {})
    # Every name but a folder's: a FIFO or a device named as a dump is refused, never skipped.
    for files in (sorted(p for p in d.iterdir() if not p.is_dir()), sorted(p for p in d.rglob("*") if not p.is_dir())):
        found = _match(files, prefix, d)
        if found[1]:
            break
    return found


def _match(files: list[Path], prefix: str | None, d: Path) -> tuple[str, dict[int, Path]]:
    if prefix is None:
        prefix = DEFAULT_PREFIX if any(p.name.startswith(DEFAULT_PREFIX) for p in files) else \
            _infer_prefix([p.name for p in files if re.search(r"[0-9]$", p.name)], str(d))  # fmt: skip
    if prefix is None:
        return DEFAULT_PREFIX, {}
    found: dict[int, Path] = {}
    for p in files:
        rank = _rank_of(p, prefix)
        if rank is None:
            continue
        if rank in found:
            raise fr.FlightRecorderError(path=str(p), reason=f"a second dump of rank {rank} (the first: "
                                         f"{found[rank]}); pass the folder of one job's dumps")  # fmt: skip
        found[rank] = p
    return prefix, found


def _rank_of(path: Path, prefix: str) -> int | None:
    """The rank of a file named ``<prefix><r>`` (the traces' rule for ``<r>``), None for another name.

    A look-alike (``<prefix>01``, a non-ASCII digit), a rank beyond ``MAX_RANKS`` or a dump that is not a
    regular file is refused: skipped, it would leave a rank "missing" that did dump, or shadow one.
    """
    name = path.name
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    rank = rank_number(rest)
    if rank is None:
        if looks_like_a_rank(rest):
            raise fr.FlightRecorderError(path=str(path), reason=f"not a dump's name: <r> of {prefix}<r> is a rank in "
                                         "ASCII digits without leading zeros; rename or remove it")  # fmt: skip
        return None
    why = beyond(rank)
    if why is None:
        try:
            mode = os.stat(path).st_mode  # follows a symlink: its target must be a regular file
        except OSError as exc:
            raise fr.FlightRecorderError(path=str(path), reason=f"cannot read it ({exc.strerror or exc})") from None
        why = None if stat.S_ISREG(mode) else f"is {kind_of(mode)}, not a regular file; replay reads only regular files"
    if why is not None:
        raise fr.FlightRecorderError(path=str(path), reason=why)
    return rank


def _infer_prefix(names: list[str], where: str) -> str | None:
    """torch's ``fr_trace`` prefix inference (``loader._determine_prefix``); None when no name ends in a rank."""
    if not names:
        return None
    from torch.distributed.flight_recorder.components.loader import _determine_prefix

    try:
        return _determine_prefix(names)
    except ValueError:
        raise fr.FlightRecorderError(path=where, reason="its files ending in a number have more than one prefix; "
                                     "name the dumps' prefix with --fr-prefix") from None  # fmt: skip


@dataclass(frozen=True, slots=True)
class NativeDumps:
    """The dumps of one folder, by rank, as they are on disk (``normalise`` makes torch's analyzer read them)."""

    prefix: str
    dumps: dict[int, dict[str, Any]]
    paths: dict[int, Path]

    @property
    def missing(self) -> tuple[int, ...]:
        """Ranks below the highest dumped one that left no dump (a rank above it cannot be told apart)."""
        return tuple(r for r in range(max(self.dumps, default=-1) + 1) if r not in self.dumps)


def load_native_dir(directory: Path | str, prefix: str | None = None) -> NativeDumps:
    """Every ``<prefix><rank>`` dump under ``directory``; one that is not a dump raises ``FlightRecorderError``."""
    prefix, paths = dump_files(directory, prefix)
    return NativeDumps(prefix, {rank: load_dump(p) for rank, p in paths.items()}, paths)


def normalise(dumps: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Copies of ``dumps`` whose ``pg_config`` names every group the entries use, as torch's analyzer needs.

    A group the dump's own ``pg_config`` describes (NCCL's) keeps that description. The others (all of
    gloo's) get as members the ranks with an entry of the group in their dump (``pg_status`` is keyed by a
    process-local id, not the group's name, so it cannot say); the default group (``default_pg``) every rank
    up to the highest dumped one.
    """
    world = list(range(max(dumps, default=-1) + 1))
    members: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for rank, d in dumps.items():
        for e in d["entries"]:
            name, desc = str(e["process_group"][0]), str(e["process_group"][1])
            members.setdefault(name, set()).add(rank)
            descs.setdefault(name, desc)
    out = {}
    for rank, d in dumps.items():
        own = {str(k): v for k, v in d["pg_config"].items() if k and isinstance(v, dict) and v.get("ranks") != "[]"}
        config = dict(own)
        for name, ranks in members.items():
            if name in config or name not in descs:
                continue  # described by the dump itself, or used by no entry: nothing refers to it
            if rank not in ranks:
                continue  # a rank's pg_config lists only its own groups
            default = descs[name] == "default_pg"
            config[name] = {"name": name, "desc": descs[name], "ranks": str(world if default else sorted(ranks))}
        out[rank] = {**d, "pg_config": config}
    return out
