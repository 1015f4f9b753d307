"""``miles-fsm demo``: the whole loop on the embedded default, and every injection kind end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from proctable import live_processes
from test_demo_faults import fault_wall

from miles_fsm.apps.cli import main
from miles_fsm.apps.demo import Injection
from miles_fsm.states import Strategy

GUARD_S = 3.0
#: Every surviving rank and the parent must be out within the guard timeout plus this.
MARGIN_S = 10.0


def _records(trace_dir: Path, rank: int) -> list[dict]:
    return [orjson.loads(line) for line in (trace_dir / f"rank-{rank}.jsonl").read_bytes().splitlines() if line]


def _session_pids(sid: int) -> set[int]:
    """Live processes of session ``sid`` (the demo runs as a session leader, so all its descendants are in it)."""
    return {p.pid for p in live_processes() if p.sid == sid}


def _wait_session_empty(sid: int, within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := _session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.slow
def test_demo_cli_exits_0_prints_the_summary_and_writes_a_trace_per_rank(demo_runs):
    """The default demo through the CLI: exit 0, a summary per transition, every cycle verified, rank-<r>.jsonl each."""
    run = demo_runs.get(steps=3)  # the run test_demo_verifies_every_cycle... checks the result of
    rc, out, tmp_path = run.rc, run.out, run.trace_dir
    assert not run.left, f"processes left behind: {sorted(run.left)}"
    assert rc == 0, out
    for phase in ("offload", "pause", "rematerialize", "sync", "resume", "train"):
        assert re.search(rf"^│ {phase} ", out, re.M), f"no summary row for {phase}:\n{out}"
    assert "host bytes held while PAUSED (rematerialize)" in out
    assert "of which bf16 params 0 B" in out
    assert str(tmp_path) in out.splitlines()[-1]
    for rank in (0, 1):
        records = _records(tmp_path, rank)
        assert sum(r["event"] == "verified" for r in records) == 3
        assert sum(r["event"] == "demo_step" for r in records) == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(Strategy))
def test_demo_verifies_every_cycle_and_reports_host_bytes_per_mode(mode, demo_runs):
    """Both modes verify every cycle bit-exact; rematerialize holds no host bf16 params, backup holds all of them."""
    run = demo_runs.get(ranks=2, steps=3, mode=mode.value)
    assert not run.left, f"processes left behind: {sorted(run.left)}"
    result = run.result
    assert result is not None, run.out + run.err
    assert result.ok, result.diagnosis
    assert result.verified == {0: 3, 1: 3}
    held = result.held()
    if mode is Strategy.REMATERIALIZE:
        assert held["actor_bf16_params"] == 0
        assert 0 < held["actor"] < held["bf16_params"]
    else:
        assert held["actor_bf16_params"] == held["bf16_params"]
    names = {row["name"] for row in result.summary()}
    assert {"start", "offload", "pause", "generate", "rematerialize", "sync", "resume", "train"} <= names


def _run_injected(argv: list[str], capsys, trace_dir: Path, culprit: int) -> tuple[int, str, float]:
    """Exit code, stdout, and seconds from the fault (its trace timestamp) to the last rank out."""
    rc = main(["demo", "--guard-timeout", str(GUARD_S), "--trace-dir", str(trace_dir), *argv])
    out_at = time.time()
    return rc, capsys.readouterr().out, out_at - fault_wall(trace_dir, culprit, ranks=2)


def _rank_lines(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^  rank (\d+): .*$", out, re.M)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "mode", "error"),
    [
        ("diverge", "rematerialize", "RankDivergenceError"),
        ("diverge", "backup", "RankDivergenceError"),
        ("crash", "rematerialize", "FaultLocatedError"),  # dies inside param_sync: rank 0 is in the all-gather
        ("crash", "backup", "PeerLostError"),  # dies inside restore: rank 0 finds it gone at the next guard
        ("corrupt", "rematerialize", "FaultLocatedError"),
        ("corrupt", "backup", "PeerFailedError"),  # rank 1 fails its verify; rank 0 is told so at the next guard
    ],
)
def test_injected_fault_names_the_culprit_and_everyone_exits_in_time(
    kind, mode, error, tmp_path, capsys, assert_no_leftovers
):
    """Each injection at rank 1, step 2: exit non-zero within guard + margin; the diagnosis and every
    rank's error name rank 1."""
    rc, out, wall = _run_injected(["--mode", mode, "--steps", "3", "--inject", f"{kind}:1:2"], capsys, tmp_path, 1)
    assert rc != 0, out
    assert wall < GUARD_S + MARGIN_S, f"took {wall:.1f} s from the fault"
    assert "culprit: rank 1\n" in out, out
    lines = _rank_lines(out)
    survivor = lines[0]
    assert error in survivor, out
    assert re.search(r"rank\(s\) 1\b", survivor), f"rank 0's error does not name rank 1: {survivor}"
    if kind == "crash":
        where = "param_sync" if mode == "rematerialize" else "restore"
        assert "died without reporting (SIGKILL)" in lines[1] and where in lines[1], out
    else:  # the culprit itself fails too, and knows it
        assert re.search(r"rank\(s\) 1\b", lines[1]), out
    if kind == "diverge":
        # The guard's report names the param that rank 1 alone left out of its buffers.
        messages = [r.get("message") or "" for r in _records(tmp_path, 0)]
        assert any("ranks [1] lack pos.weight" in m for m in messages), messages


@pytest.mark.slow
def test_hang_as_a_subprocess_names_the_hung_rank_and_leaves_no_process(tmp_path):
    """A rank that stops before its guard: the others time out naming it, it is killed, nothing survives,
    all within guard + margin of the fault (its trace timestamp: interpreter start is not the fault's)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_fsm", "demo", "--mode", "backup", "--steps", "3", "--guard-timeout", str(GUARD_S),
         "--inject", "hang:1:2", "--trace-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = _wait_session_empty(proc.pid, 5.0)
    wall = time.time() - fault_wall(tmp_path, 1, ranks=2)
    assert not left, f"processes left behind: {sorted(left)}"
    assert proc.returncode == 1, out + err
    assert wall < GUARD_S + MARGIN_S, f"took {wall:.1f} s from the fault"
    assert "culprit: rank 1\n" in out, out
    lines = _rank_lines(out)
    assert "GuardTimeoutError" in lines[0] and "rank(s) 1 did not reach the guard" in lines[0], out
    assert "blocked or hung" in lines[1] and "transition_started offload" in lines[1], out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path):
    """SIGINT to the demo's process group (what Ctrl-C sends) ends the run with 130 and no process left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_fsm", "demo", "--steps", "200", "--trace-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # As from a terminal: a suite started in the background (`cmd &` in a script) inherits
        # SIGINT ignored, and Python then leaves it ignored, so Ctrl-C would never reach the demo.
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until both ranks are inside the loop
            if all((tmp_path / f"rank-{r}.jsonl").exists() for r in (0, 1)) and all(
                any(rec["event"] == "demo_step" for rec in _records(tmp_path, r)) for r in (0, 1)
            ):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the demo never started its steps")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = _wait_session_empty(proc.pid, 5.0)
    assert not left, f"processes left behind: {sorted(left)}"
    assert proc.returncode == 130, out + err
    assert "interrupted" in out


def test_injection_parsing_and_validation(capsys):
    """--inject takes KIND:RANK:STEP; a bad kind, a rank outside the world or a step past the run
    is a usage error (exit 2)."""
    assert Injection.parse("crash:1:2") == Injection(kind="crash", rank=1, step=2)
    for bad in ("explode:1:2", "crash:1", "crash:x:2"):
        with pytest.raises(ValueError):
            Injection.parse(bad)
    for argv in (["--inject", "explode:0:1"], ["--inject", "hang:5:1"], ["--inject", "hang:0:9", "--steps", "2"]):
        with pytest.raises(SystemExit) as exc:
            main(["demo", *argv])
        assert exc.value.code == 2
    assert "step must be in 1..2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ranks", "100000"], "--ranks must be in 1..64"),
        (["--ranks", "0"], "--ranks must be in 1..64"),
        (["--guard-timeout", "inf"], "--guard-timeout must be finite"),
        (["--guard-timeout", "1e12"], "--guard-timeout must be finite, > 0 and <= 86400 s"),
        (["--guard-timeout", "nan"], "--guard-timeout must be finite"),
        (["--steps", "1000001"], "--steps must be in 1..100000"),
    ],
)
def test_out_of_range_flags_are_one_line_usage_errors(argv, says, capsys, assert_no_leftovers):
    """Sizes and timeouts the demo cannot honour (100000 ranks, an infinite or 30000-year guard) exit 2
    with one line on stderr naming the flag, before any process starts."""
    from conftest import child_pids

    before = child_pids()
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
    assert child_pids() == before


def test_unusable_trace_dir_is_a_one_line_usage_error(tmp_path, capsys, assert_no_leftovers):
    """A --trace-dir that cannot be created (it lies under a regular file) exits 2 with one line naming
    the path and the reason, before any process starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--trace-dir", str(blocker / "traces")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--trace-dir {blocker / 'traces'}: cannot use it (Not a directory)" in err, err


def test_progress_reads_only_its_own_run_and_follows_a_replaced_file(tmp_path):
    """The progress tail skips records of another run in the same file, and reads a file that replaced
    the one it was reading (rotated or moved aside) from its start, never from the old offset."""
    from miles_fsm.apps.demo.progress import _Tail

    path = tmp_path / "rank-0.jsonl"

    def write(records: list[dict], mode: str = "ab") -> None:
        with open(path, mode) as f:
            f.write(b"".join(orjson.dumps(r) + b"\n" for r in records))

    write([{"run": "old", "event": "demo_step", "pad": "x" * 200}] * 3, "wb")
    tail = _Tail(path, "new")
    assert tail.records() == []
    write([{"run": "new", "event": "demo_step", "step": 1}])
    assert [r["step"] for r in tail.records()] == [1]
    path.rename(tmp_path / "rank-0.jsonl.1")
    write([{"run": "new", "event": "demo_step", "step": 2}], "wb")  # shorter than the old offset
    assert [r["step"] for r in tail.records()] == [2]


@pytest.mark.slow
def test_a_reused_trace_dir_holds_this_run_only(tmp_path, capsys, assert_no_leftovers):
    """A 2-rank demo into a 3-rank demo's directory: the earlier rank files (rank-2 too) move to
    earlier-runs/, progress counts this run's steps only, and replay reads a healthy 2-rank run."""
    assert main(["demo", "--ranks", "3", "--steps", "3", "--trace-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["demo", "--ranks", "2", "--steps", "2", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d+)/2: verified", out, re.M) == ["1", "2"], out
    assert "moved the rank traces of earlier runs to " in out
    # Each closed trace has its index beside it, and an earlier trace's index moves with it.
    assert sorted(p.name for p in tmp_path.glob("rank-*")) == [
        "rank-0.jsonl", "rank-0.jsonl.index", "rank-1.jsonl", "rank-1.jsonl.index"]  # fmt: skip
    [earlier] = (tmp_path / "earlier-runs").iterdir()
    assert sorted(p.name for p in earlier.iterdir()) == [
        f"rank-{r}.jsonl{suffix}" for r in range(3) for suffix in ("", ".index")]  # fmt: skip
    assert len({r["run"] for rank in (0, 1) for r in _records(tmp_path, rank)}) == 1
    assert main(["replay", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("OK: 2 rank(s)")
