"""``miles-fsm replay``: reading damaged traces, diagnosing them, and the CLI contract.

Traces here are written record by record in the exact layout ``Lifecycle``
writes (``trace_writer.RankWriter``; one test also uses a real ``Lifecycle``);
damaged and hostile traces are in ``test_replay_damage.py``, the end-to-end
tests on the real demo in ``test_replay_demo.py``.
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm.apps.cli import main
from miles_fsm.replay.diagnose import diagnose, rank_ranges
from miles_fsm.replay.perfetto import export_perfetto
from miles_fsm.replay.report import render, replay
from miles_fsm.replay.files import find_traces
from miles_fsm.replay.model import EpochRange, TraceDirError
from miles_fsm.replay.read import read_rank, read_ranks
from toy import ToyEngine, ToyTrainer
from trace_writer import RankWriter, healthy

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = run_cli(capsys, *argv, "--json")
    return code, orjson.loads(out)


# ------------------------------------------------------------------ healthy


def test_healthy_traces_give_ok_and_exit_0(tmp_path, capsys):
    """Identical, complete traces: verdict ok, exit 0, every contract key present."""
    healthy(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert code == 0
    assert d["verdict"] == "ok"
    assert {"verdict", "ranks", "first_divergence", "stuck", "illegal"} <= d.keys()
    assert d["first_divergence"] is None and d["stuck"] == [] and d["illegal"] == []
    assert [r["status"] for r in d["ranks"]] == ["done"] * 3


def test_real_lifecycle_trace_replays_clean(tmp_path, capsys):
    """A trace written by a real Lifecycle (toy drivers) re-drives cleanly through the definition."""
    with Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(), config=LifecycleConfig(trace_dir=tmp_path)) as lc:
        lc.start()
        for _ in range(2):
            lc.offload(), lc.pause(), lc.rematerialize(), lc.sync(), lc.resume()
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"], d["illegal"]) == (0, "ok", [])
    assert d["ranks"][0]["transitions"] == 11 and d["ranks"][0]["verified"] == 2


def test_human_report_puts_the_verdict_first_and_is_plain_off_a_tty(tmp_path, capsys):
    """Not a TTY: plain text, one verdict line first, no ANSI escapes."""
    healthy(tmp_path)
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 0
    assert out.splitlines()[0].startswith("OK: ")
    assert "\x1b[" not in out


def test_rich_report_on_a_tty_is_styled(tmp_path):
    """On a terminal the report is styled (ANSI colour) and still starts with the verdict."""
    healthy(tmp_path)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    buf = Tty()
    render(replay(str(tmp_path)), buf)
    text = buf.getvalue()
    assert "\x1b[" in text and "OK:" in text.splitlines()[0]


# --------------------------------------------------------------- bad input


def test_missing_directory_and_empty_directory_exit_2(tmp_path, capsys):
    """No directory, or one without rank files: exit 2 with a message that says what is wrong."""
    code, _, err = run_cli(capsys, str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in err
    code, _, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and "no rank-<r>.jsonl" in err
    (tmp_path / "rank-0.jsonl").write_bytes(b"garbage\n")
    code, _, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and "no readable record" in err


def test_a_file_instead_of_a_directory_exits_2(tmp_path, capsys):
    """Passing a trace file, not its folder, is bad input and says so."""
    p = tmp_path / "rank-0.jsonl"
    p.write_bytes(b"")
    code, _, err = run_cli(capsys, str(p))
    assert code == 2 and "not a directory" in err


# ----------------------------------------------------------- damaged traces


def test_truncated_last_line_is_skipped_and_reported(tmp_path, capsys):
    """A half-written last line is reported as truncated and the rest of the file is used."""
    writers = healthy(tmp_path)
    writers[2].write(tmp_path, tail=b'{"v":1,"rank":2,"world":3,"state":"TRAI')
    code, d = as_json(capsys, str(tmp_path))
    trunc = d["trace_problems"]["truncated"]
    assert [t["rank"] for t in trunc] == [2]
    assert trunc[0]["where"].endswith(f"rank-2.jsonl:{len(writers[2].lines) + 1}")
    assert d["ranks"][2]["transitions"] == d["ranks"][0]["transitions"]


def test_garbage_lines_are_reported_with_file_and_line_then_skipped(tmp_path, capsys):
    """Garbage in the middle is reported as file:line and skipped; the diagnosis still reads the rest."""
    w = healthy(tmp_path)[1]
    lines = list(w.lines)
    lines.insert(5, b"\x00\x01 not json at all")
    lines.insert(9, b"[1, 2, 3]")
    (tmp_path / "rank-1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert "rank-1.jsonl:6: not JSON" in out
    assert "rank-1.jsonl:10: not a trace record" in out
    code, d = as_json(capsys, str(tmp_path))
    assert [b["line"] for b in d["trace_problems"]["bad_lines"]] == [6, 10]
    assert d["ranks"][1]["transitions"] == d["ranks"][0]["transitions"]


def test_lost_records_make_the_verdict_incomplete(tmp_path, capsys):
    """A record replaced by garbage leaves a sequence gap: not ok, exit 3, and the count is given."""
    w = healthy(tmp_path)[0]
    lines = list(w.lines)
    lines[7] = b"{{{"
    (tmp_path / "rank-0.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "incomplete")
    assert d["trace_problems"]["lost_records"] == {"0": 1}


def test_missing_rank_file_world_size_comes_from_the_records(tmp_path, capsys):
    """rank-3 of a 4-rank world has no file: the world is 4, rank 3 is listed missing."""
    for w in healthy(tmp_path, world=4):
        pass
    (tmp_path / "rank-3.jsonl").unlink()
    code, d = as_json(capsys, str(tmp_path))
    assert d["world"] == 4 and d["missing_ranks"] == [3]
    assert (code, d["verdict"]) == (3, "incomplete")
    assert d["ranks"][3] == {"rank": 3, "status": "missing", "file": None}


def test_clock_skew_does_not_change_the_diagnosis(tmp_path, capsys):
    """Ranks whose wall clocks are hours apart are still aligned by sequence and epoch."""
    for r, skew in enumerate((0.0, 7200.0, -3600.0)):
        w = RankWriter(r, 3, wall0=1.8e9 + skew)
        w.cycles(1)
        w.cycles(1, sync={"tensors": "b" * 32} if r == 2 else {})
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert d["verdict"] == "divergence"
    assert d["culprit"]["ranks"] == [2] and d["first_divergence"]["epoch"] == 2


# --------------------------------------------------------------- diagnosis


def test_divergence_groups_ranks_and_names_the_field(tmp_path, capsys):
    """Rank 1 plans another collective at sync of epoch 2: grouped, field named, the rank that changed blamed."""
    plan = ["all_gather@dp[128:bfloat16]"]
    for r in range(4):
        w = RankWriter(r, 4)
        w.cycles(1)
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        w.transition("sync", plan=plan if r == 1 else None)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    f = d["first_divergence"]
    assert (code, d["verdict"]) == (3, "divergence")
    assert (f["epoch"], f["transition"], f["field"]) == (2, "sync", "collectives")
    assert [g["ranks"] for g in f["groups"]] == [[0, 2, 3], [1]]
    assert f["groups"][1]["value"] == plan and f["culprits"] == [1]


def test_divergence_before_any_collective_is_found(tmp_path, capsys):
    """A rank that fires another trigger (no guard involved) diverges at that transition."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("pause" if r == 0 else "offload")  # pause is forbidden from TRAINING
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert d["verdict"] == "divergence" and d["culprit"]["ranks"] == [0]
    assert d["first_divergence"]["field"] == "trigger"
    assert any(i["rank"] == 0 and "no arrow for pause out of TRAINING" in i["reason"] for i in d["illegal"])


def test_replay_through_the_definition_flags_illegal_transitions(tmp_path, capsys):
    """Re-driving a fresh machine per rank flags a forbidden trigger, a wrong destination and foreign steps."""
    w = RankWriter(0, 1)
    w.transition("start")
    w.transition("offload")
    w.transition("rematerialize")  # from OFFLOADED: forbidden
    w2 = RankWriter(1, 1)
    w2.transition("start")
    w2.transition("offload", dest="PAUSED")
    w3 = RankWriter(2, 1)
    w3.transition("start", steps=["backup(ref)", "param_sync"])
    w.write(tmp_path), w2.write(tmp_path), w3.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    reasons = defaultdict(str)
    for i in d["illegal"]:
        reasons[i["rank"]] += i["reason"] + "|"
    assert "no arrow for rematerialize out of OFFLOADED" in reasons[0]
    assert "offload leads to OFFLOADED" in reasons[1]
    assert "are not steps of start" in reasons[2]
    assert code == 3


def test_events_after_failed_without_recover_are_illegal(tmp_path):
    """A trigger fired while FAILED, with no recover in between, is flagged."""
    w = RankWriter(0, 1)
    w.cycles(1, resume={"verify_failed": ["w"]})
    w.state = "SYNCED"  # the trace claims to go on as if nothing happened
    w.transition("resume")
    w.write(tmp_path)
    t = read_rank(tmp_path / "rank-0.jsonl", 0)
    assert any("while FAILED" in i.reason for i in t.illegal)


def test_hung_rank_is_stuck_with_state_and_duration(tmp_path, capsys):
    """Rank 2 never reaches the sync guard; the others time out naming it: stuck, with what and how long."""
    timeout = {"error": "GuardTimeoutError", "message": "rank(s) 2 did not reach the guard",
               "fields": {"missing": [2]}}
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        if r == 2:
            w.transition("sync", stop="planning")
        else:
            w.emit("demo_tick", dt=5.0)  # the survivors' clocks run on while they wait
            w.transition("sync", guard_error=timeout)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "stuck")
    [s] = d["stuck"]
    assert (s["rank"], s["state"], s["epoch"], s["transition"], s["how"]) == (2, "REMATERIALIZED", 2, "sync", "stuck")
    assert "before its guard" in s["inside"] and s["silent_s"] > 4.0
    assert s["accused_by"] == [0, 1]


def test_crashed_rank_is_told_from_stuck_by_lost_peers(tmp_path, capsys):
    """The survivors' guard lost its peer (PeerLostError naming rank 1): crashed, inside its last action."""
    lost = {"error": "PeerLostError", "message": "lost its connection to rank(s) 1", "fields": {"missing": [1]}}
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause")
        if r == 1:
            w.transition("rematerialize", stop="cast_main_to_params")
        else:
            w.transition("rematerialize")
            w.transition("sync", guard_error=lost)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert d["verdict"] == "crashed"
    assert d["culprit"] == {"ranks": [1], "decided": True, "suspects": [1], "epoch": 2, "transition": "rematerialize",
                            "position": 8}
    [s] = d["stuck"]
    assert s["how"] == "crashed" and s["inside"] == "action cast_main_to_params of rematerialize"


def test_peer_failure_inside_a_collective_blames_the_silent_rank(tmp_path, capsys):
    """Survivors fail in param_sync with 'Connection reset by peer'; the rank that went silent there crashed."""
    reset = {"action": "param_sync", "error": "RuntimeError", "message": "Read error: Connection reset by peer",
             "transport": "peer_lost"}
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause"), w.transition("rematerialize")
        w.transition("sync", stop="param_sync" if r == 0 else None, step_error=None if r == 0 else reset)
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (d["verdict"], d["culprit"]["ranks"], d["culprit"]["transition"]) == ("crashed", [0], "sync")
    assert d["stuck"][0]["how"] == "crashed"


def test_without_evidence_crashed_or_stuck_is_said_to_be_unknown(tmp_path, capsys):
    """Rank 0 stops inside an action and the others wait at the guard, beyond its timeout after rank 0's last
    record: stuck, and the report says it cannot tell a crash from a hang."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause")
        if r == 0:
            w.transition("rematerialize", stop="restore(actor)")
        else:
            w.transition("rematerialize")
            w.emit("demo_tick", dt=6.0)  # they reach the guard longer after rank 0's last record than it waits
            w.transition("sync", stop="guard")
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    [s] = d["stuck"]
    assert (d["verdict"], s["rank"], s["how"]) == ("stuck", 0, "unknown")
    assert "cannot tell whether it crashed or hung" in s["evidence"]
    assert s["waited_on_by"] == [1, 2]


def test_every_rank_cut_off_at_once_is_incomplete_not_blamed(tmp_path, capsys):
    """All ranks end inside the same action (the job was killed from outside): incomplete, no culprit."""
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload", stop="backup(actor)")
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"], d["culprit"], d["stuck"]) == (3, "incomplete", None, [])
    assert "stopped from outside" in d["headline"]


def test_truncated_tail_means_the_process_died_writing(tmp_path, capsys):
    """With no survivor evidence, a cut-short last line is what tells crashed from stuck."""
    for r in range(2):
        w = RankWriter(r, 2)
        w.cycles(1)
        w.transition("offload")
        if r == 1:
            w.transition("pause", stop="engine.push_weights")
            w.write(tmp_path, tail=b'{"v":1,"rank":1,"wor')
        else:
            w.transition("pause"), w.transition("rematerialize"), w.transition("sync", stop="guard")
            w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert (d["verdict"], d["stuck"][0]["rank"], d["stuck"][0]["how"]) == ("crashed", 1, "crashed")


def test_verification_failure_names_the_tensors(tmp_path, capsys):
    """A verify_failed record gives verdict corrupt with the tensor names, the rank, epoch and transition."""
    for r in range(2):
        w = RankWriter(r, 2)
        w.cycles(1)
        w.cycles(1, resume={"verify_failed": ["layers.0.w", "layers.1.b"]} if r == 1 else {})
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    assert d["verdict"] == "corrupt"
    assert d["culprit"] == {"ranks": [1], "decided": True, "suspects": [1], "epoch": 2, "transition": "resume",
                            "position": 10}
    assert d["verification"][0]["tensors"] == ["layers.0.w", "layers.1.b"]
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert "layers.0.w, layers.1.b" in out.splitlines()[0]


def test_straggler_is_the_slowest_rank_against_the_median(tmp_path, capsys):
    """Rank 2 spends 3x the median in rematerialize: flagged with its ratio; the others are not."""
    for r in range(5):
        w = RankWriter(r, 5)
        w.cycles(3, rematerialize={"slow": 3.0} if r == 2 else {})
        w.write(tmp_path)
    code, d = as_json(capsys, str(tmp_path))
    flagged = [s for s in d["stragglers"] if s["straggler"]]
    assert [(s["transition"], s["slowest_rank"]) for s in flagged] == [("rematerialize", 2)]
    assert flagged[0]["ratio"] == pytest.approx(3.0, rel=0.01)
    assert flagged[0]["worst"]["rank"] == 2


def test_rank_and_epoch_filters(tmp_path, capsys):
    """--rank keeps the named ranks (others are not 'missing'); --epoch keeps those epochs only."""
    healthy(tmp_path, world=4, cycles=3)
    code, d = as_json(capsys, str(tmp_path), "--rank", "1-2", "--rank", "0")
    assert [r["rank"] for r in d["ranks"]] == [0, 1, 2] and d["missing_ranks"] == [] and code == 0
    code, d = as_json(capsys, str(tmp_path), "--epoch", "2")
    assert code == 0 and {r["transitions"] for r in d["ranks"]} == {5}
    code, d = as_json(capsys, str(tmp_path), "--epoch", "2:")
    assert {r["transitions"] for r in d["ranks"]} == {10}
    assert EpochRange.parse("3") == EpochRange(first=3, last=3)
    code, _, err = run_cli(capsys, str(tmp_path), "--rank", "9")
    assert code == 2 and "no trace for rank(s) 9" in err


def test_parallel_read_matches_serial(tmp_path):
    """Folding ranks in worker processes gives exactly what a serial fold gives."""
    healthy(tmp_path, world=4)
    files = find_traces(tmp_path)
    serial = diagnose(read_ranks(files, workers=1)).to_json()
    parallel = diagnose(read_ranks(files, workers=2)).to_json()
    assert serial == parallel


def test_rank_ranges_are_compact():
    """Rank lists print as ranges, so a 1024-rank report stays readable."""
    assert rank_ranges([5, 0, 1, 2, 7, 8, 9]) == "0-2, 5, 7-9"


def test_trace_dir_error_is_raised_by_the_library(tmp_path):
    """The library raises TraceDirError (the CLI turns it into exit 2)."""
    with pytest.raises(TraceDirError):
        replay(str(tmp_path))


# ---------------------------------------------------------------- Perfetto


def check_chrome_trace(path: Path) -> dict[str, Any]:
    """Validate a Chrome trace: structure, fields per phase, and B/E properly nested per (pid, tid)."""
    doc = orjson.loads(path.read_bytes())
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    stacks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    last_ts: dict[tuple[int, int], float] = {}
    flows: dict[int, list[str]] = defaultdict(list)
    for ev in doc["traceEvents"]:
        ph = ev["ph"]
        assert ph in {"B", "E", "X", "i", "M", "s", "t", "f", "C"}
        assert isinstance(ev["pid"], int)
        if ph == "M":
            continue
        assert isinstance(ev["ts"], (int, float)) and isinstance(ev["tid"], int)
        key = (ev["pid"], ev["tid"])
        if ph in "BEi":
            assert ev["ts"] >= last_ts.get(key, float("-inf")), f"time goes back on {key}"
            last_ts[key] = ev["ts"]
        if ph == "B":
            assert ev["name"]
            stacks[key].append(ev)
        elif ph == "E":
            assert stacks[key], f"E without B on {key}"
            begin = stacks[key].pop()
            assert ev["name"] == begin["name"] and ev["ts"] >= begin["ts"]
        elif ph in "stf":
            flows[ev["id"]].append(ph)
    assert all(not s for s in stacks.values()), "unclosed B slices"
    for phases in flows.values():
        assert phases[0] == "s" and phases[-1] == "f" and set(phases[1:-1]) <= {"t"}
    return doc


def test_perfetto_export_is_a_valid_nested_chrome_trace(tmp_path, capsys):
    """pid = rank, states and transitions as nested B/E, guard failures as instants, guards linked by flows."""
    timeout = {"error": "GuardTimeoutError", "message": "rank 2 missing", "fields": {"missing": [2]}}
    traces = tmp_path / "t"
    traces.mkdir()
    for r in range(3):
        w = RankWriter(r, 3)
        w.cycles(1)
        w.transition("offload"), w.transition("pause")
        if r == 2:
            w.transition("rematerialize", stop="restore(actor)")  # left open: closed as unfinished
        else:
            w.transition("rematerialize"), w.transition("sync", guard_error=timeout)
        w.write(traces)
    out = tmp_path / "trace.json"
    code, _, err = run_cli(capsys, str(traces), "--perfetto", str(out))
    assert code == 3 and "Perfetto" in err
    doc = check_chrome_trace(out)
    events = doc["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    names = {(e["pid"], e["tid"], e["name"]) for e in events if e["ph"] == "B"}
    assert (0, 1, "TRAINING") in names and (0, 2, "sync") in names and (0, 2, "guard") in names
    assert (2, 2, "restore(actor)") in names
    assert any(e["ph"] == "i" and e["name"] == "guard failed: GuardTimeoutError" for e in events)
    assert {e["pid"] for e in events if e["ph"] in "stf"} == {0, 1, 2}  # sync guard of epoch 1 on all
    unfinished = [e for e in events if e["ph"] == "E" and e.get("args", {}).get("unfinished")]
    assert any(e["pid"] == 2 for e in unfinished)


def test_perfetto_epoch_filter(tmp_path):
    """--epoch limits the timeline to those epochs."""
    healthy(tmp_path, cycles=3)
    out = tmp_path / "t.json"
    traces = read_ranks(find_traces(tmp_path))
    export_perfetto(traces, out, epochs=EpochRange(first=2, last=2))
    doc = check_chrome_trace(out)
    epochs = {e["args"]["epoch"] for e in doc["traceEvents"] if e["ph"] == "B" and e.get("cat") == "transition"}
    assert epochs == {2}
