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
    _assert_replay_blames_nobody(traces, "its launcher " + ("got SIGTERM" if sig == signal.SIGTERM else "died"))
    print(f"SIGNAL {signal.Signals(sig).name} {inject or 'running'}: every process gone {took:.2f} s after")


def _default_sigint() -> None:
    # As from a terminal: a suite started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _replay(trace_dir: Path) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "miles_fsm", "replay", str(trace_dir), "--json"],
                          capture_output=True, timeout=60)
    return done.returncode, orjson.loads(done.stdout)


def _assert_replay_blames_nobody(trace_dir: Path, cause: str) -> None:
    """Replay says the run was stopped from outside, names no culprit and no suspect, and calls no rank
    crashed or stuck: the operator's stop is no rank's fault."""
    code, d = _replay(trace_dir)
    assert (code, d["verdict"]) == (3, "incomplete"), d["headline"]
    assert "stopped from outside" in d["headline"] and cause in d["headline"], d["headline"]
    assert d["culprit"]["ranks"] == [] and d["culprit"]["suspects"] == [], d["culprit"]
    assert not [s for s in d["stuck"] if s["how"] in ("crashed", "stuck")], d["stuck"]


@pytest.mark.parametrize(
    ("sig", "inject"),
    [(signal.SIGINT, None), (signal.SIGHUP, "hang:1:2"), (signal.SIGTERM, "hang:1:2")],
    ids=["ctrl-c-running", "SIGHUP-during-a-hang", "SIGTERM-during-a-hang"],
)
def test_an_operator_stop_is_recorded_on_every_rank_and_blames_nobody(sig, inject, tmp_path):
    """Ctrl-C (SIGINT to the terminal's whole process group), SIGHUP or SIGTERM: every rank's trace ends
    in a trace_closed saying its launcher stopped it on that signal, even a rank hung before its guard
    and one waiting inside the guard's collective, and replay blames nobody. Before the launcher told
    its ranks why, they died mid-record and replay named one of them."""
    traces = tmp_path / "traces"
    argv = [sys.executable, "-m", "miles_fsm", "demo", "--steps", "300", "--guard-timeout", "30",
            "--trace-dir", str(traces)] + (["--inject", inject] if inject else [])
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 60
        while min(_steps(traces, 0), _steps(traces, 1)) < 1:
            assert time.monotonic() < deadline, "the demo never started its steps"
            time.sleep(0.05)
        time.sleep(1.0 if inject else 0.2)  # a hang: rank 1 is inside it and rank 0 waits at the guard
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does: every process of the group
        else:
            os.kill(proc.pid, sig)
        proc.wait(timeout=MARGIN_S)
        left = _session(proc.pid)
        end = time.monotonic() + 5.0
        while left and time.monotonic() < end:
            time.sleep(0.05)
            left = _session(proc.pid)
    finally:
        for pid in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not left, f"processes left behind: {sorted(left)}"
    assert proc.returncode == 128 + sig, (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    name = signal.Signals(sig).name
    for rank in (0, 1):
        last = _records(traces, rank)[-1]
        assert (last["event"], last["error"]) == ("trace_closed", "RankStoppedError"), last
        assert (last["fields"]["reason"], last["fields"]["signal"]) == ("signal", name), last
    _assert_replay_blames_nobody(traces, f"its launcher got {name}")
