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


def run_in_session(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own (stdout and stderr together); afterwards nothing of that session
    may be alive (launchers such as torchrun start processes that outlive a careless test)."""
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    deadline = time.monotonic() + 10
    while [p for p in live_processes() if p.sid == proc.pid] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p.pid for p in live_processes() if p.sid == proc.pid]
    assert not left, f"processes left behind: {left}"
    return proc.returncode, out
