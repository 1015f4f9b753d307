"""``miles-fsm replay`` on runs that are not healthy, on damaged files and on hostile input.

What OK means (every rank's trace ends in a clean ``trace_closed``, nothing
failed outside a transition), mixed runs in one directory, records out of
order, and input that must give a one-line error (exit 2) or a diagnosis
(exit 3), never a traceback or a hang. Property tests over generated
damage are in ``test_replay_properties.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from miles_fsm.apps.cli import main
from test_replay import as_json, run_cli
from trace_writer import RUN, RankWriter, healthy


def rewrite(path: Path, edit: Any) -> None:
    """Replace a trace file's lines by ``edit(lines)``."""
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(edit(lines)) + b"\n")


def killed_in_train_step(root: Path, *, transport: str | None) -> None:
    """3 ranks; rank 1 dies in the guarded train step, the survivors' train step fails and names it."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.train_guard(stop=r == 1)
        if r != 1:
            failed = {"error": "RuntimeError", "message": "[gloo] Connection reset by peer", "transport": transport}
            w.emit("demo_failed", where="train", culprits=[1], **failed)
            w.close(error="FaultLocatedError", message="rank stopped; culprit rank(s) 1",
                    fields={"rank": r, "culprits": [1], "evidence": "rank 1: process gone", "cause": "RuntimeError"})
        w.write(root)


# ------------------------------------------------------- what OK means


@pytest.mark.parametrize("transport", [None, "peer_lost"])
def test_a_rank_killed_in_the_train_step_is_not_ok(tmp_path, capsys, transport):
    """Rank 1 dies between transitions; the survivors' demo_failed names it: exit 3, culprit rank 1."""
    killed_in_train_step(tmp_path, transport=transport)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["culprit"]["ranks"]) == (3, [1]), d["headline"]
    assert d["verdict"] == ("crashed" if transport == "peer_lost" else "stuck")
    [s] = d["stuck"]
    assert s["rank"] == 1 and "train" in s["inside"]


def test_a_failure_outside_any_transition_is_a_problem(tmp_path, capsys):
    """A rank whose own step failed outside the lifecycle (demo_failed, unclean close) is crashed, not ok."""
    for r in range(2):
        w = RankWriter(r, 2)
        w.cycles(1)
        if r == 0:
            w.emit("demo_failed", where="generate", error="ValueError", message="bad prompt", culprits=None)
            w.close(error="ValueError", message="bad prompt", transport=None)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"], d["culprit"]["ranks"]) == (3, "crashed", [0]), d["headline"]
    assert "ValueError" in d["headline"] and "generate" in d["headline"]


def test_an_unclean_trace_closed_alone_is_a_problem(tmp_path, capsys):
    """A lifecycle left by an exception (trace_closed clean=false) is reported even without other records."""
    for r in range(2):
        w = RankWriter(r, 2)
        w.cycles(1)
        if r == 1:
            w.close(error="KeyboardInterrupt", message="", transport=None)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"], d["culprit"]["ranks"]) == (3, "crashed", [1]), d["headline"]


def test_a_trace_without_trace_closed_is_incomplete_and_says_where_it_stopped(tmp_path, capsys):
    """Rank 2 was cut off between transitions with nobody waiting on it: incomplete, its last record named."""
    w = healthy(tmp_path)[2]
    w.lines.pop()  # its trace_closed
    w.write(tmp_path, close=False)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "incomplete"), d["headline"]
    assert "rank 2" in d["headline"] and "transition_finished" in d["headline"]
    assert d["ranks"][2]["closed"] is None and d["ranks"][0]["closed"] == "clean"


def test_schema_v1_traces_without_trace_closed_are_never_ok(tmp_path, capsys):
    """v1 traces (no run, no trace_closed) are read as one run with a warning, and cannot be called ok."""
    for r in range(2):
        w = RankWriter(r, 2, run=None)
        w.cycles(1)
        w.lines = [ln.replace(b'"v":2', b'"v":1') for ln in w.lines]
        w.write(tmp_path, close=False)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "incomplete")
    assert any("no run id" in w for w in d["trace_problems"]["warnings"])


# --------------------------------------------------------- record order


def test_shuffled_records_are_read_in_seq_order(tmp_path, capsys):
    """A file whose lines are shuffled replays exactly as the ordered one: ok, with a warning."""
    healthy(tmp_path)
    rewrite(tmp_path / "rank-1.jsonl", lambda ls: ls[::-1])
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok"), d["headline"]
    assert any("out of sequence order" in w for w in d["trace_problems"]["warnings"])


def test_duplicate_records_are_dropped_and_reported(tmp_path, capsys):
    """Exact copies of records (same seq, same bytes) are dropped and listed; the run stays ok."""
    healthy(tmp_path)
    rewrite(tmp_path / "rank-0.jsonl", lambda ls: [*ls[:9], ls[3], *ls[9:], ls[5], ls[6]])
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok"), d["headline"]
    assert [x["seq"] for x in d["trace_problems"]["duplicates"]] == [3, 5, 6]


def test_a_lost_record_alone_never_reads_as_divergence(tmp_path, capsys):
    """Two ranks, one loses a transition_started: the shifted positions are damage, not a divergence."""
    healthy(tmp_path, world=2)
    rewrite(tmp_path / "rank-1.jsonl", lambda ls: [ln for ln in ls if b'"seq":20,' not in ln])
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "incomplete"), d["headline"]


# ----------------------------------------------------------- mixed runs


def stale_rank_2(root: Path) -> None:
    """A 3-rank run, then a 2-rank run written into the same directory: rank-2.jsonl is the old run's."""
    healthy(root, world=3, run="old-run")
    healthy(root, world=2, run="new-run")


def test_a_directory_of_two_runs_is_refused_naming_runs_and_files(tmp_path, capsys):
    """Files of different runs are never mixed: exit 2, one line naming each run with its files, and --run."""
    stale_rank_2(tmp_path)
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert "new-run" in line and "old-run" in line and "rank-2.jsonl" in line and "--run" in line


def test_run_picks_one_run_and_lists_the_files_it_ignored(tmp_path, capsys):
    """--run new-run reads ranks 0-1 only (world 2, nothing missing) and says rank-2.jsonl was ignored."""
    stale_rank_2(tmp_path)
    code, d = as_json(capsys, str(tmp_path), "--run", "new-run")
    assert (code, d["verdict"], d["world"], d["missing_ranks"]) == (0, "ok", 2, [])
    assert [Path(p).name for p in d["trace_problems"]["ignored"]] == ["rank-2.jsonl"]
    code, _, err = run_cli(capsys, str(tmp_path), "--run", "nope")
    assert code == 2 and "no record of run nope" in err and "new-run" in err


def test_a_file_that_changes_run_midway_is_reported(tmp_path, capsys):
    """A rank file whose records switch run is named in the refusal; --run reads that run's records of it."""
    healthy(tmp_path, world=2)
    other = RankWriter(1, 2, run="other-run")
    other.cycles(1)
    with open(tmp_path / "rank-1.jsonl", "ab") as f:
        f.write(b"\n".join(other.lines) + b"\n")
    code, _, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and "rank-1.jsonl changes run midway" in err
    code, d = as_json(capsys, str(tmp_path), "--run", RUN)
    assert (code, d["verdict"]) == (0, "ok"), d["headline"]
    assert any("other-run" in w for w in d["trace_problems"]["warnings"])


# --------------------------------------------------------- hostile input

_HOSTILE = {
    "huge int": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":99999999999999999999999,"event":"transition_started",'
    b'"epoch":1,"state":"TRAINING","trigger":"offload","dest":"OFFLOADED","steps":[]}',
    "u64 epoch": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":5000,"event":"transition_started",'
    b'"epoch":18446744073709551615,"state":"TRAINING","trigger":"offload","dest":"OFFLOADED","steps":[]}',
    "list for str": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":5000,"event":"transition_started","epoch":1,'
    b'"state":["TRAINING"],"trigger":["offload"],"dest":{"a":1},"steps":[{"x":1}]}',
    "dict for int": b'{"v":2,"run":"%s","rank":0,"world":{"n":3},"seq":{"n":4},"event":"guard_failed","epoch":{},'
    b'"state":"TRAINING","trigger":"sync","error":{"e":1},"message":[1],"fields":{"missing":7}}',
    "error record with junk": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":5001,"event":"verify_failed","epoch":1,'
    b'"state":"x","trigger":"sync","tensors":5,"where":[1]}',
    "action-like non-JSON": b'{"v":2,"event":"action_started", "seq": oops}',
    "NaN": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":3,"event":"guard_passed","duration_s":NaN}',
    "Infinity": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":3,"event":"action_finished","duration_s":Infinity}',
    "deep JSON": b'{"v":2,"run":"%s","event":"demo_failed","seq":2,"culprits":[0],"error":"E","fields":'
    + b'[' * 2000 + b']' * 2000 + b"}",
    "deep but parseable": b'{"v":2,"run":"%s","rank":0,"world":3,"seq":5002,"epoch":0,"event":"demo_failed",'
    b'"culprits":[0],"error":"E","message":"m","fields":{"x":' + b"[" * 600 + b"]" * 600 + b"}}",
    "huge world": b'{"v":2,"run":"%s","rank":0,"world":1000000000000,"seq":5003,"epoch":0,"event":"demo_step"}',
}


@pytest.mark.parametrize("kind", list(_HOSTILE))
@pytest.mark.parametrize("where", ["middle", "end"])
def test_hostile_lines_give_a_diagnosis_never_a_traceback(tmp_path, capsys, kind, where):
    """Each hostile line in a healthy trace: exit 3 (the trace is damaged), JSON that parses, a timeline too."""
    healthy(tmp_path)
    line = _HOSTILE[kind].replace(b"%s", RUN.encode())
    rewrite(tmp_path / "rank-0.jsonl", lambda ls: [*ls[:7], line, *ls[7:]] if where == "middle" else [*ls, line])
    code, d = as_json(capsys, str(tmp_path), "--perfetto", str(tmp_path / "t.json"))
    assert code == 3 and d["verdict"] != "ok"
    assert d["trace_problems"]["bad_lines"] or d["trace_problems"]["lost_records"], d["trace_problems"]
    orjson.loads((tmp_path / "t.json").read_bytes())
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 3 and out.splitlines()[0].startswith(d["verdict"].upper())


def test_a_100_mb_line_is_reported_not_read(tmp_path, capsys):
    """One line of 100 MB is a bad line (over the record size limit), the rest is read."""
    healthy(tmp_path)
    with open(tmp_path / "rank-1.jsonl", "ab") as f:
        f.write(b'{"event":"action_started","x":"' + b"x" * (100 << 20) + b'"}\n')
    code, d = as_json(capsys, str(tmp_path))
    assert code == 3
    [bad] = d["trace_problems"]["bad_lines"]
    assert bad["where"].endswith("rank-1.jsonl:%d" % (len((tmp_path / "rank-0.jsonl").read_bytes().splitlines()) + 1))
    assert "MiB" in bad["reason"]


def _replay_subprocess(*argv: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "miles_fsm", "replay", *argv], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "dev zero", "directory"])
def test_a_rank_file_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, kind):
    """A FIFO, a symlink to /dev/zero or a directory named rank-0.jsonl: exit 2 at once, one line, no traceback."""
    healthy(tmp_path)
    p = tmp_path / "rank-0.jsonl"
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev zero":
        p.symlink_to("/dev/zero")
    else:
        p.mkdir()
    proc = _replay_subprocess(str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "rank-0.jsonl" in proc.stderr and "regular file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kind", ["a directory", "a missing parent", "unwritable", "an input file"])
def test_bad_perfetto_paths_exit_2_with_one_line(tmp_path, capsys, kind):
    """--perfetto into a directory, under a missing folder, into a read-only folder or onto a trace: exit 2."""
    traces = tmp_path / "traces"
    traces.mkdir()
    healthy(traces)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    out = {"a directory": tmp_path, "a missing parent": tmp_path / "no" / "t.json", "unwritable": ro / "t.json",
           "an input file": traces / "rank-1.jsonl"}[kind]  # fmt: skip
    before = (traces / "rank-1.jsonl").read_bytes()
    try:
        if kind == "unwritable" and os.access(ro, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        code, out_text, err = run_cli(capsys, str(traces), "--perfetto", str(out))
    finally:
        ro.chmod(0o700)
    assert code == 2 and out_text == "" and len(err.strip().splitlines()) == 1 and "--perfetto" in err
    assert (traces / "rank-1.jsonl").read_bytes() == before


@pytest.mark.parametrize("epoch", ["99", "-1"])
def test_an_epoch_that_selects_nothing_is_bad_input(tmp_path, capsys, epoch):
    """--epoch with no such epoch is exit 2 with one line that says which epochs exist."""
    healthy(tmp_path)
    code, out, err = run_cli(capsys, str(tmp_path), f"--epoch={epoch}")
    assert code == 2 and out == "" and "--epoch" in err and "epochs 0-2" in err
    assert len(err.strip().splitlines()) == 1


def test_an_empty_epoch_range_is_a_usage_error(tmp_path, capsys):
    """--epoch 5:2 is refused when parsed (exit 2, argparse's usage line and why), before any reading."""
    healthy(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path), "--epoch", "5:2"])
    assert exc.value.code == 2
    assert "the range is empty" in capsys.readouterr().err.strip().splitlines()[-1]


def test_an_absurd_rank_range_is_bad_input(tmp_path, capsys):
    """--rank 0-10**12 is refused at once instead of building a trillion-entry list."""
    healthy(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path), "--rank", "0-1000000000000"])
    assert exc.value.code == 2
    assert "--rank" in capsys.readouterr().err


def test_a_rank_file_number_beyond_any_world_is_refused(tmp_path, capsys):
    """rank-10000000000.jsonl would make a world of ten billion ranks: exit 2 naming the file."""
    healthy(tmp_path)
    (tmp_path / "rank-10000000000.jsonl").write_bytes((tmp_path / "rank-0.jsonl").read_bytes())
    code, _, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and "rank-10000000000.jsonl" in err
