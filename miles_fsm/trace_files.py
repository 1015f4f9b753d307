"""Finding per-rank trace files and reading them in blocks, never whole.

Only regular files are read: a FIFO or a device named ``rank-0.jsonl`` would
block or never end, so it is refused before anything is opened for reading.
A line longer than a block is not a record any writer makes; it is skipped
and stands in the line numbering as ``OVERSIZED``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from miles_fsm.trace_checks import MAX_RANKS
from miles_fsm.trace_model import TraceDirError

__all__ = ["MAX_LINE", "OVERSIZED", "blocks", "default_workers", "find_traces", "iter_lines", "preview"]

_NAME = re.compile(r"^rank-(\d+)\.jsonl$")
_BLOCK = 1 << 24
#: The longest line read; longer ones are reported, not parsed (memory stays bounded).
MAX_LINE = _BLOCK
#: Stands for a line over ``MAX_LINE``: not JSON, so the reader reports it as a bad line.
OVERSIZED = b"<a line over 16 MiB, not read>"


def find_traces(path: str | os.PathLike[str]) -> dict[int, Path]:
    """``rank-<r>.jsonl`` files in a directory, by rank. Rotated ``.jsonl.<n>`` files are older runs."""
    root = Path(path)
    if not root.exists():
        raise TraceDirError(root, "no such directory")
    if not root.is_dir():
        raise TraceDirError(root, "not a directory (give the folder that holds rank-<r>.jsonl)")
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise TraceDirError(root, f"cannot list it ({exc.strerror or exc})") from exc
    found = {int(m.group(1)): root / n for n in names if (m := _NAME.match(n))}
    if not found:
        raise TraceDirError(root, "holds no rank-<r>.jsonl trace files")
    for rank, p in found.items():
        if rank >= MAX_RANKS:
            raise TraceDirError(p, f"rank {rank} is beyond any world replay reads (at most {MAX_RANKS} ranks)")
        try:
            mode = os.stat(p).st_mode  # follows a symlink: its target must be a regular file
        except OSError as exc:
            raise TraceDirError(p, f"cannot read it ({exc.strerror or exc})") from exc
        _check_regular(p, mode)
    return dict(sorted(found.items()))


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")  # fmt: skip
        raise TraceDirError(path, f"is {kind}, not a regular file; replay reads only regular files")


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
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        _check_regular(path, os.fstat(fd).st_mode)
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
            lines = (tail + block if tail else block).split(b"\n")
            tail = lines.pop()
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
