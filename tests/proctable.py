"""The live process table, read from /proc (tests check it for leftovers)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    sid: int


def live_processes() -> list[Proc]:
    """Every process that is not a zombie."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The command name may hold spaces and parentheses: split after the last ')'.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out.append(Proc(pid=int(entry), ppid=int(fields[1]), sid=int(fields[3])))
    return out
