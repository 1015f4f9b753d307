"""The demo's parent dies or is told to stop: every rank stops too, and no trace reads as healthy.

The demo runs as a subprocess in its own session (all its processes share
the session id) with its own ``TMPDIR``, so multiprocessing's ``pymp-*``
folder is this run's alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from proctable import live_processes

pytestmark = pytest.mark.slow

GUARD_S = 3.0
MARGIN_S = 10.0


def _records(trace_dir: Path, rank: int) -> list[dict]:
    path = trace_dir / f"rank-{rank}.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line] if path.exists() else []


def _steps(trace_dir: Path, rank: int) -> int:
    return sum(r["event"] == "demo_step" for r in _records(trace_dir, rank))


def _session(sid: int) -> set[int]:
    return {p.pid for p in live_processes() if p.sid == sid}


@pytest.mark.parametrize("inject", [None, "hang:1:2"], ids=["running", "during-a-hang"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_parent_signal_stops_every_rank_and_leaves_no_healthy_trace(sig, inject, tmp_path):
    """SIGTERM or SIGKILL to the demo parent: every process of the run is gone within guard + 10 s, no
    pymp-* folder is left, no rank runs another step, and no rank's trace ends with a clean
    trace_closed. SIGTERM exits 143 saying so; after SIGKILL each rank says its launcher died."""
    traces, tmp = tmp_path / "traces", tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "miles_fsm", "demo", "--steps", "300", "--guard-timeout", str(GUARD_S),
            "--trace-dir", str(traces)] + (["--inject", inject] if inject else [])
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        # Files, not pipes: orphaned ranks holding a pipe would keep communicate() waiting forever.
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True, env={**os.environ,
                                "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 60
        while min(_steps(traces, 0), _steps(traces, 1)) < (1 if inject else 2):
            assert time.monotonic() < deadline, "the demo never started its steps"
            time.sleep(0.05)
        time.sleep(1.0 if inject else 0.2)  # a hang: rank 1 is inside it and rank 0 waits at the guard
        steps_at = [_steps(traces, r) for r in (0, 1)]
        os.kill(proc.pid, sig)
        signalled = time.monotonic()
        proc.wait(timeout=GUARD_S + MARGIN_S)
        while _session(proc.pid) and time.monotonic() - signalled < GUARD_S + MARGIN_S:
            time.sleep(0.05)
        took = time.monotonic() - signalled
        left = _session(proc.pid)
    finally:
        for pid in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not left, f"processes left behind: {sorted(left)}"
    assert took < GUARD_S + MARGIN_S
    assert not list(tmp.glob("pymp-*")), "multiprocessing's temp folder was left behind"
    assert [_steps(traces, r) for r in (0, 1)] <= [s + 1 for s in steps_at], "ranks kept running"
    for rank in (0, 1):
        last = _records(traces, rank)[-1]
        assert not (last["event"] == "trace_closed" and last["clean"]), f"rank {rank}'s trace reads healthy"
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert "Traceback" not in stderr, stderr
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM and "interrupted (SIGTERM)" in stdout, stdout + stderr
    else:
        for rank in (0, 1):
            assert f"rank {rank}: its launcher (pid {proc.pid}) died" in stderr, stderr
            last = _records(traces, rank)[-1]
            assert (last["event"], last["error"]) == ("trace_closed", "LauncherLostError"), last
    print(f"SIGNAL {signal.Signals(sig).name} {inject or 'running'}: every process gone {took:.2f} s after")
