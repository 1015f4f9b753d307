"""Finding per-rank trace files and reading them in blocks, never whole.

A rank file is named ``rank-<r>.jsonl`` with ``<r>`` in ASCII digits,
without leading zeros: the one name ``Tracer`` writes. Any other name of
that look (``rank-01.jsonl``, ``rank-\u0662.jsonl``, a trailing space) is
not read as a rank's trace, which it might shadow or stand in for; it is
listed, and the replay of the directory is then never ok.

Only regular files are read: a FIFO or a device named ``rank-0.jsonl`` would
block or never end, so it is refused before anything is opened for reading,
and every file is opened without blocking and checked again once open. A
line longer than a block is not a record any writer makes; it is skipped
and stands in the line numbering as ``OVERSIZED``.

The same rules hold for every file replay reads: Flight Recorder dumps are
named ``<prefix><r>`` with ``<r>`` spelled as above (``rank_number``), read
whole only up to a cap (``read_capped``), and refused when not regular.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from miles_fsm.replay.checks import MAX_RANKS
from miles_fsm.replay.model import Damage, TraceDirError

__all__ = ["MAX_LINE", "OVERSIZED", "RankFiles", "beyond", "blocks", "default_workers", "find_traces", "iter_lines",
           "kind_of", "looks_like_a_rank", "open_regular", "preview", "rank_files", "rank_number", "read_capped", "trace_rank"]  # fmt: skip

_NUMBER = re.compile(r"0|[1-9][0-9]*")  # fullmatch, ASCII only: "$" would let a trailing newline through
_BLOCK = 1 << 24
#: The longest line read; longer ones are reported, not parsed (memory stays bounded).
MAX_LINE = _BLOCK
#: Stands for a line over ``MAX_LINE``: not JSON, so the reader reports it as a bad line.
OVERSIZED = b"<a line over 16 MiB, not read>"


@dataclass(frozen=True, slots=True)
class RankFiles:
    """A directory's rank files by rank, and the names that look like rank files but are not (damage)."""

    files: dict[int, Path]
    misnamed: list[Damage]


def find_traces(path: str | os.PathLike[str]) -> dict[int, Path]:
    """``rank-<r>.jsonl`` files in a directory, by rank. Rotated ``.jsonl.<n>`` files are older runs."""
    return rank_files(path).files


def rank_files(path: str | os.PathLike[str]) -> RankFiles:
    """The rank files of a directory, and its look-alike names. Raises ``TraceDirError`` when it holds none."""
    root = Path(path)
    if not root.exists():
        raise TraceDirError(root, "no such directory")
    if not root.is_dir():
        raise TraceDirError(root, "not a directory (give the folder that holds rank-<r>.jsonl)")
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise TraceDirError(root, f"cannot list it ({exc.strerror or exc})") from exc
    found = {r: root / n for n in names if (r := trace_rank(n)) is not None}
    odd = sorted(n for n in names if _looks_like_a_rank_file(n) and trace_rank(n) is None)
    if not found:
        also = f" ({', '.join(map(repr, odd[:4]))}: {_NOT_A_NAME})" if odd else ""
        raise TraceDirError(root, f"holds no rank-<r>.jsonl trace files{also}")
    for rank, p in found.items():
        why = beyond(rank)
        if why is not None:
            raise TraceDirError(p, why)
        try:
            mode = os.stat(p).st_mode  # follows a symlink: its target must be a regular file
        except OSError as exc:
            raise TraceDirError(p, f"cannot read it ({exc.strerror or exc})") from exc
        _check_regular(p, mode)
    misnamed = [Damage(path=str(root / n), line=0, records=0, reason=_misnamed(n, found)) for n in odd]
    return RankFiles(files=dict(sorted(found.items())), misnamed=misnamed)


_NOT_A_NAME = "not a rank file name (a rank's trace is rank-<r>.jsonl, <r> in ASCII digits without leading zeros)"


def rank_number(text: str) -> int | None:
    """The rank ``text`` spells as a writer spells it (ASCII digits, no leading zero), else None.

    The one rule for every file named after a rank: traces and Flight Recorder dumps alike.
    """
    return int(text) if _NUMBER.fullmatch(text) else None


def looks_like_a_rank(text: str) -> bool:
    """``text`` reads as a number some other way (``01``, a non-ASCII digit, a space): a look-alike, never a rank."""
    t = text.strip()
    return bool(t) and (t.isdigit() or t.isdecimal() or t.isnumeric()) and rank_number(text) is None


def beyond(rank: int) -> str | None:
    """Why ``rank`` is not believed (at or above ``MAX_RANKS``), or None."""
    return f"rank {rank} is beyond any world replay reads (at most {MAX_RANKS} ranks)" if rank >= MAX_RANKS else None


def trace_rank(name: str) -> int | None:
    """The rank a trace file's name spells (``rank-<r>.jsonl`` by ``rank_number``'s rule), else None."""
    if not (name.startswith("rank-") and name.endswith(".jsonl")):
        return None
    return rank_number(name[len("rank-") : -len(".jsonl")])


def _looks_like_a_rank_file(name: str) -> bool:
    return name.startswith("rank-") and name.strip().lower().endswith(".jsonl")


def _misnamed(name: str, found: dict[int, Path]) -> str:
    try:
        rank: int | None = int(name.strip()[len("rank-") : -len(".jsonl")])
    except ValueError:
        rank = None
    beside = f"; it would read as rank {rank}" + (f", beside {found[rank].name}" if rank in found else "") \
        if rank is not None and rank >= 0 else ""  # fmt: skip
    return f"{_NOT_A_NAME}: not read{beside}"


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise TraceDirError(path, f"is {kind_of(mode)}, not a regular file; replay reads only regular files")


def kind_of(mode: int) -> str:
    """What a file that is not regular is, in words."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a regular file" if stat.S_ISREG(mode) else "not a file")  # fmt: skip


def open_regular(path: Path) -> int:
    """A descriptor of ``path`` opened without blocking, once it is known to be a regular file.

    A FIFO or a device opened to read may block or never end: it is refused (``TraceDirError``) before a
    byte is read, whatever its name. ``OSError`` when it cannot be opened at all.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        _check_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: Path, limit: int, what: str) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (``what`` names the cap in the refusal).

    ``TraceDirError`` for a file that is not regular or is larger (its size is checked before, and its length
    while, it is read: a file that grows as it is read is refused too); ``OSError`` when it cannot be read.
    """
    fd = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise TraceDirError(path, f"is {size} bytes, over the {limit}-byte cap of {what}; not read")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TraceDirError(path, f"grew past the {limit}-byte cap of {what} while it was read; not read")
    return data


def default_workers(paths: Iterable[Path]) -> int:
    # A worker process costs about a second to start (it imports torch through
    # miles_fsm), so spread only when there is far more than that to read.
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            continue  # read_rank reports it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, 8) if total > 256 << 20 else 1


def blocks(path: Path) -> Iterable[tuple[list[bytes], bool]]:
    """(lines, True) block by block; then ([the incomplete last line], False) if there is one.

    Opened without blocking and checked again once open, so a file swapped
    for a FIFO after ``find_traces`` looked cannot hang the reader.
    """
    with open(open_regular(path), "rb", buffering=0) as f:
        tail = b""
        skipping = False  # inside a line over MAX_LINE: drop bytes up to its newline
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            head: list[bytes] = []
            if skipping:
                nl = block.find(b"\n")
                if nl < 0:
                    continue
                block, skipping, head = block[nl + 1 :], False, [OVERSIZED]
            joined = bool(tail)
            lines = (tail + block if tail else block).split(b"\n")
            tail = lines.pop()
            if joined and lines and len(lines[0]) > MAX_LINE:  # begun in the block before: it may be longer
                lines[0] = OVERSIZED
            if len(tail) > MAX_LINE:
                tail, skipping = b"", True
            yield (head + lines if head else lines), True
    if skipping:
        yield [OVERSIZED], False
    elif tail:
        yield [tail], False


def preview(line: bytes) -> str:
    return line[:120].decode("utf-8", "replace")


def iter_lines(path: Path) -> Iterable[tuple[int, bytes, bool]]:
    """(line number, bytes, complete) for each line, read in blocks; the last may be incomplete."""
    lineno = 0
    for lines, complete in blocks(path):
        for line in lines:
            lineno += 1
            yield lineno, line, complete
