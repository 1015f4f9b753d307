"""Hostile inputs for replay, and the CLI run under the bounds a user relies on (time, address space).

``bounded`` runs ``miles-fsm replay`` in a child process with ``RLIMIT_AS``
of ``MEMORY`` and kills it past ``SECONDS``; it returns the exit code, the
output, the wall time and the child's own peak RSS (``wait4``). A replay
that needs more memory fails with ``MemoryError`` (exit 1), so the bound is
the test. The interpreter with replay's imports (no torch) peaks near
35 MiB of RSS; 512 MiB of address space leaves room for what replay reads.

The dump builders write what the issue describes, byte for byte where it
matters (the opcodes), small enough to write in a test.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HOLE", "LENGTH_OPCODES", "MEMORY", "SECONDS", "Run", "bomb", "bounded", "dump_doc", "entry", "giant_length",
           "nested_lists", "opcodes", "pickled", "spliced", "wide", "write"]

MEMORY = 512 << 20
SECONDS = 10.0


@dataclass(frozen=True)
class Run:
    code: int | None  # None: killed at the time limit
    out: str
    err: str
    wall_s: float
    max_rss_mib: float

    @property
    def one_line(self) -> bool:
        """Bad input, said in one line on stderr and nothing on stdout (the contract of exit 2)."""
        return self.code == 2 and len(self.err.strip().splitlines()) == 1 and self.out == ""


# A small launcher forks replay under the limits and reports its exit code and peak RSS (wait4). Not a
# preexec_fn in the test process: a child forked from a large process counts the parent's pages in its
# ru_maxrss. SIGXFSZ ignored: a write past RLIMIT_FSIZE then fails with EFBIG, as a write to a full disk fails.
_LAUNCH = """import os, resource, signal, sys
memory, size, report = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if size >= 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    os.execv(sys.argv[4], sys.argv[4:])
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def bounded(*argv: str, seconds: float = SECONDS, memory: int = MEMORY, file_size: int | None = None) -> Run:
    """``miles-fsm replay *argv`` in a child under ``memory`` bytes of address space, killed after ``seconds``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report"
        limits = [str(memory), str(-1 if file_size is None else file_size), str(report)]
        start = time.monotonic()
        p = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCH, *limits, sys.executable, "-m", "miles_fsm",
                              "replay", *argv], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
        try:
            p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and replay: nothing is left behind
            p.wait()
        wall = time.monotonic() - start
        code, rss = (int(x) for x in report.read_text().split()) if report.exists() else (None, 0)
        out.seek(0)
        err.seek(0)
        return Run(code, out.read().decode(errors="replace"), err.read().decode(errors="replace"), wall, rss / 1024)


def entry(**over: Any) -> dict[str, Any]:
    """One Flight Recorder entry as torch writes it (gloo), with ``over`` in place of its fields."""
    e = {"record_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "p2p_seq_id": 0,
         "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "output_sizes": [[4]],
         "input_dtypes": ["Float"], "output_dtypes": ["Float"], "state": "scheduled",
         "time_created_ns": 1_700_000_000_000_000_000, "is_p2p": False, "retired": True}  # fmt: skip
    return {**e, **over}


def dump_doc(*entries: dict[str, Any], ranks: Any = "[0]") -> dict[str, Any]:
    """A dump of ``entries`` whose ``pg_config`` describes group ``0`` with ``ranks``."""
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
            "pg_status": {}, "entries": list(entries or [entry()])}  # fmt: skip


def bomb(levels: int = 60) -> list[Any]:
    """``[X, X]`` nested ``levels`` deep, each level the same list twice: 2**levels leaves, pickled in ~1.5 KB
    (the pickler writes the second reference as a memo GET)."""
    x: list[Any] = [1]
    for _ in range(levels):
        x = [x, x]
    return x


def opcodes(*parts: bytes) -> bytes:
    """A protocol-4 pickle of hand-written opcodes, ``STOP`` added."""
    return b"\x80\x04" + b"".join(parts) + b"."


def nested_lists(depth: int) -> bytes:
    """``depth`` lists each inside the one before: every EMPTY_LIST first, then one APPEND per level."""
    return opcodes(b"]" * depth, b"a" * (depth - 1))


def wide(fan: int = 200, levels: int = 4) -> list[Any]:
    """``levels`` lists of ``fan`` references to the one below: ``fan**levels`` leaves, shallow, in a few KB."""
    x: list[Any] = list(range(fan))
    for _ in range(levels - 1):
        x = [x] * fan
    return x


def pickled(doc: Any) -> bytes:
    """``doc`` as protocol 2 writes it: no frames, so opcodes can be spliced in (``spliced``)."""
    return pickle.dumps(doc, protocol=2)


#: A string value whose opcode ``spliced`` replaces: put it where the hostile value goes.
HOLE = "__HOLE__"


def spliced(doc: Any, body: bytes) -> bytes:
    """``doc`` pickled with the opcodes ``body`` (one value, no memo) where it holds ``HOLE``."""
    marker = b"X" + struct.pack("<I", len(HOLE)) + HOLE.encode()
    data = pickled(doc)
    assert data.count(marker) == 1, "put HOLE in the document once"
    return data.replace(marker, body)


LENGTH_OPCODES = {"BINBYTES8": b"\x8e", "BYTEARRAY8": b"\x96", "BINUNICODE8": b"\x8d"}


def giant_length(opcode: str, n: int = 1 << 62) -> bytes:
    """A pickle whose ``opcode`` says ``n`` bytes follow, where a few do."""
    return opcodes(LENGTH_OPCODES[opcode] + struct.pack("<Q", n), b"xxxx")


def write(folder: Path, name: str | bytes, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(os.fsdecode(os.path.join(os.fsencode(folder), os.fsencode(name))))
    path.write_bytes(data)
    return path
