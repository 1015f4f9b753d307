"""Where replay may write (``--perfetto OUT``, and any output after it): never over what it reads.

An output is refused, before the long read, when it is a folder, a FIFO or
a device (``/dev/full``), or the same file as any file replay reads: its
traces, their indexes, the Flight Recorder dumps. The same file is told by
device and inode, not by name, so a hard link or a symbolic link to a trace
is caught under any name. A file named as a run's evidence in a folder of
its traces or dumps is refused too, whether or not this replay reads it.

An output is written to a temporary file beside it and renamed over it
once complete: a full disk or a write error leaves no half-written file
behind that looks complete, only one line (``OutputPathError``, exit 2).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from miles_fsm.errors import MilesFsmError
from miles_fsm.replay.files import kind_of

__all__ = ["OutputPathError", "check_output", "written"]


class OutputPathError(MilesFsmError, ValueError):
    """``--perfetto OUT`` cannot be written there: bad input, exit code 2."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"--perfetto {self.path}: {reason}")


#: Names of a run's own evidence: rank traces (rotated too), their indexes, Flight Recorder dumps (torch's too).
_EVIDENCE = re.compile(r"^(rank-[^/]*\.jsonl(\.\d+)?|.*\.index|fr-rank-[^/]*\.json|nccl_trace_rank_\d+)$")


def check_output(out: str | os.PathLike[str], inputs: Iterable[Path], folders: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Raise ``OutputPathError`` unless ``out`` can be written and is none of the files replay reads.

    ``inputs``: files read; ``folders``: where the run's traces and Flight Recorder dumps are. Every file
    under them (dumps are searched recursively) is compared with ``out`` by device and inode, and a file
    there named as one of them (``rank-*.jsonl``, ``*.index``, ``fr-rank-*.json``) is refused by name too.
    """
    path = Path(out)
    dirs = [Path(f) for f in folders]
    try:
        st: os.stat_result | None = os.stat(path)  # follows a symlink: what it points at is what is written
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputPathError(path, "is a directory; give a file name such as trace.json")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputPathError(path, f"is {kind_of(st.st_mode)}, not a regular file; an output is written only to "
                              "a regular file")  # fmt: skip
    folder = Path(os.path.realpath(path)).parent
    if not folder.is_dir():
        raise OutputPathError(path, f"its folder {path.parent} does not exist")
    if not os.access(folder, os.W_OK):
        raise OutputPathError(path, f"its folder {path.parent} is not writable")
    if st is not None:
        same = _same_file((st.st_dev, st.st_ino), [*inputs, *_files_under(dirs)])
        if same is not None:
            raise OutputPathError(path, f"is the same file as {same}, which replay reads (a link to it); it would "
                                  "be overwritten: write it elsewhere")  # fmt: skip
    target = path.resolve()
    if _EVIDENCE.match(target.name) and any(f.resolve() in target.parents for f in dirs):
        raise OutputPathError(path, "is named as the run's own evidence (a rank trace, an index or a Flight "
                              "Recorder dump) in its folder; it would be overwritten: write it elsewhere")


def _files_under(folders: list[Path]) -> Iterator[Path]:
    for folder in folders:
        for root, _dirs, names in os.walk(folder):
            yield from (Path(root) / n for n in names)


def _same_file(key: tuple[int, int], files: Iterable[Path]) -> Path | None:
    for p in files:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == key:
            return p
    return None


@contextmanager
def written(out: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A file to write ``out`` through: a temporary one beside it, renamed over ``out`` when the block ends.

    A symbolic link at ``out`` keeps pointing where it did, at the new file. Any ``OSError`` (a full disk,
    a file too large) removes the temporary file and raises ``OutputPathError``: ``out`` is left as it was.
    """
    target = Path(os.path.realpath(out))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise OutputPathError(out, f"cannot be written ({exc.strerror or exc})") from None
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputPathError(out, f"cannot be written ({exc.strerror or exc}); nothing was left there") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
