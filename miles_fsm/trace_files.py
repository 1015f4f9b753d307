"""Finding per-rank trace files and reading them in blocks, never whole."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from miles_fsm.trace_model import TraceDirError

__all__ = ["blocks", "default_workers", "find_traces", "iter_lines", "preview"]

_NAME = re.compile(r"^rank-(\d+)\.jsonl$")
_BLOCK = 1 << 24


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
    return dict(sorted(found.items()))


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
    """(lines, True) block by block; then ([the incomplete last line], False) if there is one."""
    with open(path, "rb") as f:
        tail = b""
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            lines = (tail + block if tail else block).split(b"\n")
            tail = lines.pop()
            yield lines, True
    if tail:
        yield [tail], False


def preview(line: bytes) -> str:
    return line[:120].decode("utf-8", "replace")


def iter_lines(path: Path) -> Iterable[tuple[int, bytes, bool]]:
    """(line number, bytes, complete) for each line, read in blocks; the last may be incomplete."""
    lineno = 0
    with open(path, "rb") as f:
        tail = b""
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            for line in lines:
                lineno += 1
                yield lineno, line, True
        if tail:
            yield lineno + 1, tail, False
