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
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_fsm import flight_recorder as fr

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


def load_dump(path: Path | str) -> dict[str, Any]:
    """One rank's dump, checked to be one; ``FlightRecorderError`` (``UnsafeDumpError``) otherwise."""
    p = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise fr.FlightRecorderError(path=p, reason=f"cannot read it ({exc.strerror or exc})") from None
    try:
        doc = _Restricted(data, p).load()
    except UnsafeDumpError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        # What a cut-off or foreign file makes the unpickler raise; the file is named, the job can go on.
        cut = isinstance(exc, EOFError) or "truncated" in str(exc)
        why = "it ends early (truncated)" if cut else f"not a pickle ({type(exc).__name__})"
        raise fr.FlightRecorderError(path=p, reason=f"{why}: {str(exc)[:80] or 'no detail'}") from None
    return checked(doc, p)


def checked(doc: Any, path: str) -> dict[str, Any]:
    """``doc`` if it is a dump: a dict with a version, a pg_config dict and entries torch's analyzer can read.

    Every field replay or torch's analyzer reads is checked for its type here, so a malformed dump is one
    error naming its file and field, not a traceback from deep inside either.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise fr.FlightRecorderError(path=path, reason="not a Flight Recorder dump (no 'entries' list)")
    if not isinstance(doc.get("version"), str) or not isinstance(doc.get("pg_config"), dict):
        raise fr.FlightRecorderError(path=path, reason="not a Flight Recorder dump (no 'version' string or "
                                     "'pg_config' dict)")  # fmt: skip
    _check_groups(doc["pg_config"], path)
    for i, e in enumerate(doc["entries"]):
        lacks = [k for k in _ENTRY_KEYS if not isinstance(e, dict) or k not in e]
        pg = e.get("process_group") if isinstance(e, dict) else None
        if lacks or not isinstance(pg, (list, tuple)) or len(pg) != 2 or ":" not in str(e["profiling_name"]):
            what = f"lacks {', '.join(lacks)}" if lacks else "has a malformed process_group or profiling_name"
            raise fr.FlightRecorderError(path=path, reason=f"entry {i} {what}: not a Flight Recorder dump this "
                                         "torch writes")  # fmt: skip
        for key, (ok, want) in _ENTRY_TYPES.items():
            if key in e and not ok(e[key]):
                raise fr.FlightRecorderError(path=path, reason=f"entry {i}'s {key} is {e[key]!r:.40}, not {want}: "
                                             "not a Flight Recorder dump this torch writes")  # fmt: skip
    return doc


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_list(v: Any, each: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(each(x) for x in v)


def _is_shapes(v: Any) -> bool:
    return _is_list(v, lambda s: _is_list(s, _is_int))


def _is_strings(v: Any) -> bool:
    return _is_list(v, lambda x: isinstance(x, str))


#: What each entry field must be (checked only when present: ``retired`` is newer than some dumps).
_ENTRY_TYPES: dict[str, tuple[Any, str]] = {
    **{k: (_is_int, "a whole number") for k in ("record_id", "collective_seq_id", "p2p_seq_id", "time_created_ns")},
    **{k: (_is_shapes, "a list of shapes such as [[4]]") for k in ("input_sizes", "output_sizes")},
    **{k: (_is_strings, "a list of dtype names") for k in ("input_dtypes", "output_dtypes")},
    "state": (lambda v: isinstance(v, str), "a state name"),
    "is_p2p": (lambda v: isinstance(v, bool), "true or false"),
    "retired": (lambda v: isinstance(v, bool), "true or false"),
}


def _check_groups(config: dict[Any, Any], path: str) -> None:
    """Each group ``pg_config`` describes has a ``desc`` and ``ranks``, the text of a list of ranks.

    torch's analyzer ``eval``s ``ranks`` when ``ast.literal_eval`` makes a string of it: anything but a list
    of numbers must be refused before torch sees it, or a dump could run code.
    """
    for name, group in config.items():
        if not name or not isinstance(group, dict) or group.get("ranks") == "[]":
            continue  # gloo's placeholder or no group: ``normalise`` drops it, torch never reads it
        lacks = [k for k in ("desc", "ranks") if k not in group]
        if lacks:
            raise fr.FlightRecorderError(path=path, reason=f"pg_config[{name!r}] lacks {', '.join(lacks)}: not a "
                                         "Flight Recorder dump this torch writes")  # fmt: skip
        ranks = group["ranks"]
        try:
            parsed = ast.literal_eval(ranks) if isinstance(ranks, str) else None
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            parsed = None  # refused just below, with the text that failed
        if not _is_list(parsed, _is_int):
            raise fr.FlightRecorderError(path=path, reason=f"pg_config[{name!r}] ranks is {ranks!r:.40}, not the "
                                         "text of a list of ranks such as '[0, 1]'")  # fmt: skip


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
    for files in (sorted(p for p in d.iterdir() if p.is_file()), sorted(p for p in d.rglob("*") if p.is_file())):
        found = _match(files, prefix, d)
        if found[1]:
            break
    return found


def _match(files: list[Path], prefix: str | None, d: Path) -> tuple[str, dict[int, Path]]:
    if prefix is None:
        prefix = DEFAULT_PREFIX if any(_rank_of(p.name, DEFAULT_PREFIX) is not None for p in files) else \
            _infer_prefix([p.name for p in files if re.search(r"\d$", p.name)], str(d))  # fmt: skip
    if prefix is None:
        return DEFAULT_PREFIX, {}
    found: dict[int, Path] = {}
    for p in files:
        rank = _rank_of(p.name, prefix)
        if rank is None:
            continue
        if rank in found:
            raise fr.FlightRecorderError(path=str(p), reason=f"a second dump of rank {rank} (the first: "
                                         f"{found[rank]}); pass the folder of one job's dumps")  # fmt: skip
        found[rank] = p
    return prefix, found


def _rank_of(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


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
