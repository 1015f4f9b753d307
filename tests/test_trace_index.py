"""The index a closed trace leaves beside itself: replay reads it instead of the lines, only while it holds."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import orjson
import pytest
from miles_fsm.apps.cli import main
from trace_writer import RankWriter, healthy

from miles_fsm.replay.index import load_index, write_index
from miles_fsm.trace.paths import index_path
from miles_fsm.replay.model import EpochRange
from miles_fsm.replay.read import read_rank
from miles_fsm.trace.writer import TraceIndexWarning, Tracer


def _replay(capsys, root: Path, *extra: str) -> tuple[int, dict]:
    """Exit code and --json, without the note on files read without an index (it tells the two reads apart)."""
    code = main(["replay", str(root), "--json", *extra])
    d = orjson.loads(capsys.readouterr().out)
    d["notes"] = [n for n in d["notes"] if not n.startswith("not provable without the index")]
    return code, d


def _tamper(trace: Path, **changes) -> None:
    """Rewrite the index's fold with ``changes``, keeping the CRC of the (unchanged) trace: a lying index."""
    doc = msgspec.msgpack.decode(index_path(trace).read_bytes())
    doc["trace"].update(changes)
    index_path(trace).write_bytes(msgspec.msgpack.encode(doc))


def _indexed_run(root: Path, world: int = 2) -> None:
    healthy(root, world=world, cycles=2)
    for r in range(world):
        write_index(root / f"rank-{r}.jsonl", r)


def test_a_closed_trace_leaves_an_index_that_replay_reads_instead_of_the_lines(tmp_path):
    tracer = Tracer(tmp_path, rank=0, world=1, run="r", on_close=write_index)
    tracer.emit("transition_started", epoch=1, state="TRAINING", trigger="offload", dest="OFFLOADED", steps=[])
    tracer.emit("transition_finished", epoch=1, state="OFFLOADED", trigger="offload", source="TRAINING",
                duration_s=0.5)  # fmt: skip
    trace = tracer.path
    assert not index_path(trace).exists()  # an open trace has none: a crash leaves the lines alone
    tracer.close()
    indexed = load_index(trace, 0)
    assert indexed is not None and indexed.path == str(trace)
    assert (indexed.positions, bytes(indexed.outcome), indexed.clean) == (1, b"F", True)
    # Proof that replay takes the index and not the lines: a lying index (with the trace's true CRC) is believed.
    _tamper(trace, verified=7)
    assert read_rank(trace, 0).verified == 7
    # ... but not for a filtered read, which the unfiltered fold in the index cannot answer.
    assert read_rank(trace, 0, epochs=EpochRange(first=1, last=1)).verified == 0
    assert read_rank(trace, 0, use_index=False).verified == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_a_trace_changed_after_close_is_read_from_its_lines_and_its_damage_reported(tmp_path, capsys, damage):
    _indexed_run(tmp_path)
    code, before = _replay(capsys, tmp_path)
    assert (code, before["verdict"]) == (0, "ok")
    trace = tmp_path / "rank-1.jsonl"
    data = trace.read_bytes()
    if damage == "flip":  # same size, one byte changed in place: only the CRC sees it
        i = data.index(b'"event":"guard_entered"')
        data = data[:i] + b"X" + data[i + 1 :]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data += b'{"v":2,"event":"late"}\n'
    trace.write_bytes(data)
    assert load_index(trace, 1) is None
    code, after = _replay(capsys, tmp_path)
    assert code == 3 and after["verdict"] != "ok"
    [changed] = [x for x in after["trace_problems"]["damaged"] if "closed it" in x["reason"]]
    assert changed["file"] == str(trace)
    for p in tmp_path.glob("*.index"):
        p.unlink()
    code, alone = _replay(capsys, tmp_path)
    assert code == 3 and alone["verdict"] != "ok"
    # What the lines alone say, and that the trace changed after close.
    assert same_but_the_change(after, alone)


def same_but_the_change(indexed: dict, alone: dict) -> bool:
    """The replay of changed traces with their indexes is the one of their lines, plus the change reported."""
    keys = ("culprit", "world", "ranks", "missing_ranks", "first_divergence", "stuck", "illegal", "verification",
            "guard_failures", "failures", "outside_failures", "stragglers")  # fmt: skip
    tp = dict(indexed["trace_problems"])
    tp["damaged"] = [x for x in tp["damaged"] if "changed after its writer closed it" not in x["reason"]]
    return all(indexed[k] == alone[k] for k in keys) and tp == alone["trace_problems"]


def test_an_index_that_is_damaged_foreign_or_of_another_rank_is_not_used(tmp_path):
    _indexed_run(tmp_path)
    trace = tmp_path / "rank-0.jsonl"
    good = index_path(trace).read_bytes()
    assert load_index(trace, 0) is not None
    assert load_index(trace, 1) is None  # renamed from another rank's file: its fold names that rank
    for bad in (b"", b"\x00garbage", good[: len(good) // 2]):
        index_path(trace).write_bytes(bad)
        assert load_index(trace, 0) is None
    doc = msgspec.msgpack.decode(good)
    for field, value in (("reader", "f" * 64), ("format", 99)):
        index_path(trace).write_bytes(msgspec.msgpack.encode({**doc, field: value}))
        assert load_index(trace, 0) is None, field
    # Not used is not lost: the lines are read, and say the same as the index did.
    assert read_rank(trace, 0).records == read_rank(trace, 0, use_index=False).records > 0


def test_a_restart_moves_the_index_with_the_rotated_trace(tmp_path):
    first = Tracer(tmp_path, rank=0, world=1, run="one", on_close=write_index)
    first.close()
    second = Tracer(tmp_path, rank=0, world=1, run="two", on_close=write_index)
    assert second.rotated_to == tmp_path / "rank-0.jsonl.1"
    assert index_path(second.rotated_to).exists() and not index_path(second.path).exists()
    assert load_index(second.rotated_to, 0).run == "one"
    second.close()
    assert load_index(second.path, 0).run == "two"


def test_a_stale_index_beside_an_empty_trace_is_removed(tmp_path):
    (tmp_path / "rank-0.jsonl").write_bytes(b"")
    index_path(tmp_path / "rank-0.jsonl").write_bytes(b"stale")
    tracer = Tracer(tmp_path, rank=0, world=1, run="r", on_close=write_index)
    assert tracer.rotated_to is None and not index_path(tracer.path).exists()
    tracer.close()
    assert load_index(tracer.path, 0).run == "r"


def test_an_index_that_cannot_be_written_warns_and_the_trace_stays_whole(tmp_path):
    tracer = Tracer(tmp_path, rank=0, world=1, run="r", on_close=write_index)
    index_path(tracer.path).mkdir()  # the index's name is taken by a directory: the rename fails
    with pytest.warns(TraceIndexWarning, match="its index was not written") as caught:
        tracer.close()
    assert caught[0].message.trace == str(tracer.path) and isinstance(caught[0].message.cause, OSError)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no partial index left behind
    lines = tracer.path.read_bytes().splitlines()
    assert [orjson.loads(x)["event"] for x in lines] == ["trace_opened", "trace_closed"]


def test_an_index_holds_the_fold_of_a_faulty_trace_exactly(tmp_path, capsys):
    """A stuck rank and a failed one: the diagnosis from the indexes equals the one from the lines."""
    world = 3
    for r in range(world):
        w = RankWriter(r, world)
        w.cycles(1)
        if r == 1:
            w.cycles(1, rematerialize={"stop": "planning"})
            w.write(tmp_path, close=False)
        else:
            w.cycles(1)
            w.write(tmp_path)
    from_lines = _replay(capsys, tmp_path)
    for r in range(world):
        write_index(tmp_path / f"rank-{r}.jsonl", r)
        assert load_index(tmp_path / f"rank-{r}.jsonl", r) is not None
    assert _replay(capsys, tmp_path) == from_lines
    assert from_lines[1]["verdict"] != "ok"
