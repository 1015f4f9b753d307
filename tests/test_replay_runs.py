"""``miles-fsm replay D`` on a folder of runs (one sub-folder each, as the colocated loop writes its
``--trace-dir``): each run's verdict with the command that replays it, the one ``--run`` names, and a bounded
look one level down.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import orjson
from trace_writer import RankWriter, healthy

from miles_fsm.apps.cli import main
from miles_fsm.replay import folders

SYNC_TIMEOUT = {
    "error": "GuardTimeoutError",
    "message": "rank(s) 2 did not reach the guard of sync",
    "fields": {"missing": [2]},
}


def _stuck(root: Path, run: str = "20261202-101500-4242-stuck0") -> None:
    """A 3-rank run where rank 2 hangs in offload of epoch 2 and the others time out at sync's guard."""
    root.mkdir(parents=True, exist_ok=True)
    for r in range(3):
        w = RankWriter(r, 3, run=run)
        w.cycles(1)
        if r == 2:
            w.transition("offload", stop="planning")
        else:
            for trig in ("offload", "pause", "rematerialize"):
                w.transition(trig)
            w.transition("sync", guard_error=SYNC_TIMEOUT)
        w.write(root)


def _healthy(root: Path, run: str = "20261202-101500-4242-good00") -> None:
    root.mkdir(parents=True, exist_ok=True)
    healthy(root, world=2, cycles=1, run=run)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_folder_of_runs_gives_each_verdict_the_worst_exit_and_commands_that_work(tmp_path, capsys):
    """D holds no rank file of its own but two runs, one sub-folder each: replay D gives each run's verdict
    (ok, stuck with its culprit) and the exact command that replays it in full, and exits 3 (the worst);
    the printed command, run as printed, gives that run's own report."""
    _healthy(tmp_path / "actor-rematerialize")
    _stuck(tmp_path / "actor-backup")
    code, out, err = _cli(capsys, str(tmp_path))
    assert code == 3, err
    assert "2 runs in" in out and "1 healthy" in out
    good = out.index("actor-rematerialize:")
    bad = out.index("actor-backup:")
    assert "STUCK: rank 2" in out[bad:good] and "culprit: rank(s) 2" in out[bad:good]
    assert "OK:" in out[good:]
    commands = [line.split("in full: ", 1)[1] for line in out.splitlines() if "in full: " in line]
    assert commands == [
        f"miles-fsm replay {shlex.quote(str(tmp_path / n))}" for n in ("actor-backup", "actor-rematerialize")
    ]
    argv = shlex.split(commands[0])
    assert argv[:2] == ["miles-fsm", "replay"]
    code, one, _ = _cli(capsys, *argv[2:])
    assert code == 3 and one.startswith("STUCK: rank 2") and "\nStopped ranks" in one


def test_every_run_healthy_exits_0_and_json_holds_each_diagnosis(tmp_path, capsys):
    """Two healthy runs: exit 0; --json is one object with each run's folder, command, exit code and full
    diagnosis (the single-run contract, keys and all)."""
    _healthy(tmp_path / "a")
    _healthy(tmp_path / "b", run="20261202-101500-4242-good01")
    code, out, _ = _cli(capsys, str(tmp_path), "--json")
    d = orjson.loads(out)
    assert code == 0 and d["exit_code"] == 0 and d["more"] == 0
    assert [r["folder"] for r in d["runs"]] == ["a", "b"]
    for r in d["runs"]:
        assert r["exit_code"] == 0 and r["error"] is None
        assert r["diagnosis"]["verdict"] == "ok" and {"culprit", "ranks", "trace_problems"} <= set(r["diagnosis"])


def test_run_picks_one_run_by_its_folder_or_its_run_id_and_an_unknown_one_is_bad_input(tmp_path, capsys):
    """--run NAME replays the named sub-folder in full (its own report); --run RUN_ID the sub-folder whose
    traces carry that run id; a name that is neither is one line on stderr naming the runs, exit 2."""
    _healthy(tmp_path / "a")
    _stuck(tmp_path / "b", run="run-of-b")
    code, out, _ = _cli(capsys, str(tmp_path), "--run", "b")
    assert code == 3 and out.startswith("STUCK: rank 2")
    code, out, _ = _cli(capsys, str(tmp_path), "--run", "run-of-b")
    assert code == 3 and out.startswith("STUCK: rank 2")
    code, out, err = _cli(capsys, str(tmp_path), "--run", "c")
    assert code == 2 and out == "" and "a, b" in err and len(err.strip().splitlines()) == 1


def test_one_run_in_a_folder_is_replayed_as_if_named_with_a_note(tmp_path, capsys):
    """A --trace-dir with one lifecycle's sub-folder: replay gives that run's own verdict (exit 0 when healthy)
    and says which folder it read."""
    _healthy(tmp_path / "only")
    code, out, _ = _cli(capsys, str(tmp_path))
    assert code == 0 and out.startswith("OK:")
    assert f"replayed its one run, {tmp_path / 'only'}" in out


def test_the_look_down_is_one_level_links_not_followed_and_the_list_capped(tmp_path, capsys, monkeypatch):
    """Runs two levels down are not found, a link to a run folder is not followed, and past MAX_LISTED runs
    the rest are counted, not replayed."""
    elsewhere = tmp_path / "elsewhere"
    _stuck(elsewhere)
    top = tmp_path / "top"
    _healthy(top / "deep" / "deeper")
    (top / "link").symlink_to(elsewhere, target_is_directory=True)
    code, _, err = _cli(capsys, str(top))
    assert code == 2 and "holds no rank-<r>.jsonl" in err
    monkeypatch.setattr(folders, "MAX_LISTED", 2)
    for name in ("r1", "r2", "r3"):
        _healthy(top / name)
    code, out, _ = _cli(capsys, str(top), "--json")
    d: dict[str, Any] = orjson.loads(out)
    assert code == 0 and [r["folder"] for r in d["runs"]] == ["r1", "r2"] and d["more"] == 1


def test_a_timeline_wants_one_run(tmp_path, capsys):
    """--perfetto on a folder of several runs is bad input (exit 2, one line) that says how to pick one; nothing
    is written."""
    _healthy(tmp_path / "a")
    _healthy(tmp_path / "b")
    out_json = tmp_path / "t.json"
    code, _, err = _cli(capsys, str(tmp_path), "--perfetto", str(out_json))
    assert code == 2 and "--run NAME" in err and not out_json.exists()


def test_a_folder_of_two_run_ids_names_the_command_for_each(tmp_path, capsys):
    """Rank files of two runs in one folder (a 2-rank run written where a 3-rank run was) stay bad input, and
    the message gives the exact command that replays each run; that command works as printed."""
    _stuck(tmp_path, run="old-run")
    healthy(tmp_path, world=2, cycles=1, run="new-run")
    code, _, err = _cli(capsys, str(tmp_path))
    assert code == 2
    command = f"miles-fsm replay {shlex.quote(str(tmp_path))} --run new-run"
    assert command in err
    code, out, _ = _cli(capsys, *shlex.split(command)[2:])
    assert code == 0 and "ignored" in out  # the old run's rank-2.jsonl is listed, not read
