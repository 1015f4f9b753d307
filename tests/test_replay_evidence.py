"""Replay and the demo never lose evidence: --perfetto refuses to overwrite a run's own files, and the demo's
earlier-runs/ move takes a run's Flight Recorder dumps along with its traces."""

from __future__ import annotations

import pytest
from miles_fsm.apps.cli import main
from trace_writer import healthy

from miles_fsm.apps.demo.tracedir import EARLIER_RUNS, prepare_trace_dir


@pytest.mark.parametrize("name", ["fr-rank-0.json", "rank-0.jsonl.index", "rank-7.jsonl", "rank-1.jsonl.2"])
def test_perfetto_refuses_to_overwrite_the_runs_own_evidence(tmp_path, capsys, name):
    """--perfetto onto a Flight Recorder dump, an index, or a rank trace this replay does not read: exit 2,
    one line on stderr, the file untouched."""
    healthy(tmp_path, world=2, cycles=1)
    target = tmp_path / name
    target.write_bytes(b"evidence\n")
    code = main(["replay", str(tmp_path), "--rank", "0-1", "--perfetto", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "overwritten" in err, err
    assert target.read_bytes() == b"evidence\n"


def test_perfetto_refuses_a_dump_under_the_flight_recorder_folder(tmp_path, capsys):
    (tmp_path / "traces").mkdir()
    healthy(tmp_path / "traces", world=2, cycles=1)
    (tmp_path / "fr" / "node1").mkdir(parents=True)
    dump = tmp_path / "fr" / "node1" / "fr-rank-1.json"
    dump.write_bytes(b"{}")
    code = main(["replay", str(tmp_path / "traces"), "--flight-recorder", str(tmp_path / "fr"), "--perfetto",
                 str(dump)])
    assert code == 2 and "overwritten" in capsys.readouterr().err
    assert dump.read_bytes() == b"{}"


def test_perfetto_still_writes_a_timeline_beside_the_traces(tmp_path, capsys):
    healthy(tmp_path, world=2, cycles=1)
    assert main(["replay", str(tmp_path), "--perfetto", str(tmp_path / "timeline.json")]) == 0
    assert (tmp_path / "timeline.json").stat().st_size > 0


def test_earlier_runs_move_takes_the_flight_recorder_dumps_with_the_traces(tmp_path):
    """An earlier run's rank traces, index and fr-rank-*.json dumps all move together; nothing else does."""
    names = ["rank-0.jsonl", "rank-0.jsonl.index", "rank-1.jsonl", "fr-rank-0.json", "fr-rank-1.json",
             "nccl_trace_rank_0"]
    for n in names:
        (tmp_path / n).write_bytes(n.encode())
    (tmp_path / "notes.txt").write_bytes(b"mine")
    moved = prepare_trace_dir(tmp_path)
    assert moved is not None and moved.parent == tmp_path / EARLIER_RUNS
    assert sorted(p.name for p in moved.iterdir()) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == [EARLIER_RUNS, "notes.txt"]
