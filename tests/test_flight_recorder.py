"""The Flight Recorder: its dumps read back, the plan audit that reads them, and replay's one-line explanation.

Dumps are made in the test by real gloo ranks with the recorder on (no
committed generated files); the demo cases run ``miles-fsm demo`` in-process
on 3 ranks with a short guard timeout, as tests/test_demo_faults.py does.
The demo turns the recorder on in every rank, so the megatron CPU driver is
audited every cycle by tests/test_demo_launchers.py's megatron demo (both
strategies): it passing is this audit's no-false-positive case for megatron.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest

from miles_fsm import flight_recorder as fr
from miles_fsm.apps.cli import main
from miles_fsm.launch.local import RankContext, run_ranks
from miles_fsm.plan import Collective
from miles_fsm.states.audit import PlanAudit, undeclared
from miles_fsm.states.errors import UndeclaredCollectiveError

RANKS, STEPS, GUARD_S = 3, 2, 2.0


def _collectives_then_dump(ctx: RankContext) -> dict:
    """Issue one of each collective the trainers use, on the default group and a second one, then dump."""
    import torch
    import torch.distributed as dist

    side = dist.new_group(backend="gloo", group_desc="side")
    world = ctx.world
    dist.all_reduce(torch.ones(4))
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, torch.ones(4))
    dist.broadcast(torch.ones(3), src=0)
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
    between = fr.position()
    dist.all_reduce(torch.ones(5), group=side)
    after = [str(e) for e in fr.entries(after=between)]
    fr.dump(ctx.kwargs["dir"], ctx.rank, guard_pg=str(side.group_name))
    return {"after": after}


@pytest.fixture(scope="module")
def fr_dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fr")
    outcomes = run_ranks(_collectives_then_dump, 2, timeout_s=60, kwargs={"dir": str(d)},
                         env={fr.FR_ENV: "200"})  # fmt: skip
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    (d / "after.json").write_text(json.dumps([o.result["after"] for o in outcomes]))
    return d


@pytest.mark.slow
def test_dumps_read_back_with_ops_sequence_numbers_and_groups(fr_dumps):
    """Each rank's dump reads back as its collectives in order: op, per-group sequence id, group and sizes."""
    dumps = fr.load_dir(fr_dumps)
    assert sorted(dumps) == [0, 1]
    entries = dumps[1].entries
    default = [e for e in entries if e.pg_desc == "default_pg"]
    assert [e.op for e in default[:3]] == ["all_reduce", "all_gather", "broadcast"]
    assert [e.seq for e in default] == list(range(1, len(default) + 1))
    gather = default[1]
    assert (gather.numel, gather.size) == (4, 8)  # an all-gather's declared size is its output's
    side = [e for e in entries if e.pg_desc == "side"]
    assert [(e.op, e.seq, e.numel) for e in side] == [("all_reduce", 1, 5)]
    assert dumps[1].last(skip_pgs=[side[0].pg]).pg_desc == "default_pg"  # the guard's group skipped
    # entries(after=position()) holds exactly what came after the position
    assert json.loads((fr_dumps / "after.json").read_text())[0] == [str(side[0])]


def test_corrupt_or_missing_dumps_are_one_clear_error(tmp_path):
    """A dump that is not JSON, lacks entries or a rank, or a missing folder raise FlightRecorderError naming it."""
    (tmp_path / "fr-rank-0.json").write_text("{not json")
    with pytest.raises(fr.FlightRecorderError, match="fr-rank-0.json"):
        fr.load_dir(tmp_path)
    (tmp_path / "fr-rank-0.json").write_text('{"rank": 0, "fr": {"version": "2.10"}}')
    with pytest.raises(fr.FlightRecorderError, match="no 'entries' list"):
        fr.load_file(tmp_path / "fr-rank-0.json")
    (tmp_path / "bare.json").write_text('{"entries": []}')
    with pytest.raises(fr.FlightRecorderError, match="no rank"):
        fr.load_file(tmp_path / "bare.json")
    (tmp_path / "bare.json").write_text('{"rank": "x", "entries": []}')
    with pytest.raises(fr.FlightRecorderError, match="its 'rank' is 'x', not a whole number"):
        fr.load_file(tmp_path / "bare.json")
    with pytest.raises(fr.FlightRecorderError, match="not a directory"):
        fr.load_dir(tmp_path / "nowhere")


def _entry(op: str, numel: int, *, out: int | None = None, pg: str = "0", seq: int = 1) -> fr.FrEntry:
    return fr.parse({"record_id": seq, "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
                     "input_sizes": [[numel]], "output_sizes": [[out or numel]],
                     "process_group": [pg, "default_pg"]})


def test_audit_matches_declared_collectives_by_op_and_size():
    """Declared collectives account for one issued entry each (gloo's reduce-scatter is an all-reduce);
    the rest are undeclared."""
    declared = [Collective("all_gather", "dp", "bfloat16", 8), Collective("reduce_scatter", "dp", "float32", 8)]
    issued = [_entry("all_gather", 4, out=8), _entry("all_reduce", 8, seq=2), _entry("all_reduce", 1, seq=3)]
    assert [e.seq for e in undeclared(issued, declared)] == [3]
    audit = PlanAudit(rank=1, active=lambda epoch: True, skip_pgs=["guard"])
    audit.check(issued[:2] + [_entry("all_reduce", 2, pg="guard", seq=4)], declared, epoch=1, trigger="sync",
                step="param_sync")  # the guard's own all-reduce is not the step's  # fmt: skip
    with pytest.raises(UndeclaredCollectiveError) as caught:
        audit.check(issued, declared, epoch=2, trigger="sync", step="param_sync")
    assert caught.value.fields() == {"rank": 1, "epoch": 2, "trigger": "sync", "step": "param_sync",
                                     "collective": str(issued[2]), "declared": tuple(map(str, declared))}  # fmt: skip


def test_audit_runs_on_verified_cycles_and_always_under_ci(monkeypatch):
    """VerifyConfig.audits: verified cycles only, every cycle with CI=true, never with audit=False."""
    from miles_fsm.config import VerifyConfig

    monkeypatch.delenv("CI", raising=False)
    config = VerifyConfig(cycles=2)
    assert [config.audits(e) for e in (1, 2, 3)] == [True, True, False]
    monkeypatch.setenv("CI", "true")
    assert VerifyConfig(cycles=2, ci_verifies_every_cycle=False).audits(3) is True
    assert VerifyConfig(cycles=None, audit=False).audits(1) is False


def _records(trace_dir: Path, rank: int) -> list[dict]:
    return [orjson.loads(line) for line in (trace_dir / f"rank-{rank}.jsonl").read_bytes().splitlines() if line]


def _demo(trace_dir: Path, capfd, *argv: str) -> tuple[int, str]:
    rc = main(["demo", "--ranks", str(RANKS), "--steps", str(STEPS), "--guard-timeout", str(GUARD_S),
               "--trace-dir", str(trace_dir), *argv])  # fmt: skip
    out, err = capfd.readouterr()
    return rc, out + err


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rematerialize", "backup"])
def test_audit_passes_a_normal_run(mode, tmp_path, capfd, assert_no_leftovers):
    """With the recorder on and every cycle audited, a run without faults passes: no false positive."""
    rc, text = _demo(tmp_path, capfd, "--mode", mode)
    assert rc == 0, text
    assert (tmp_path / "fr-rank-0.json").exists() is False  # dumps are written on failure only


@pytest.mark.slow
def test_audit_catches_the_undeclared_collective(tmp_path, capfd, assert_no_leftovers):
    """The injected rank fails in its step with UndeclaredCollectiveError naming step, rank and collective;
    the others fail too, and the demo names the injected rank."""
    rc, text = _demo(tmp_path, capfd, "--inject", "undeclared:1:2")
    assert rc == 1, text
    failed = [r for r in _records(tmp_path, 1) if r["event"] == "transition_failed"]
    assert failed and failed[0]["error"] == "UndeclaredCollectiveError"
    fields = failed[0]["fields"]
    assert (fields["rank"], fields["epoch"], fields["trigger"], fields["step"]) == (1, 2, "sync", "param_sync")
    assert fields["collective"].startswith("all_reduce #1 on pg demo_side")
    for rank in (0, 2):
        assert any(r["event"] in ("transition_failed", "demo_failed") for r in _records(tmp_path, rank))
    assert "culprit: rank 1" in text
    assert sorted(p.name for p in tmp_path.glob("fr-rank-*.json"))[:1] == ["fr-rank-0.json"]


@pytest.mark.slow
def test_replay_explains_the_hang_from_the_dumps(tmp_path, capfd, assert_no_leftovers):
    """With the audit off the undeclared collective hangs the ranks; replay --flight-recorder says, in one line,
    which collective each rank was in and the step that issued it, and exits 3."""
    rc, text = _demo(tmp_path, capfd, "--inject", "undeclared:1:2", "--no-audit")
    assert rc == 1, text
    assert not any(r.get("error") == "UndeclaredCollectiveError" for r in _records(tmp_path, 1))
    code = main(["replay", str(tmp_path), "--flight-recorder", str(tmp_path)])
    out, _ = capfd.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("flight recorder: "))
    assert code == 3, out
    assert "ranks 0, 2 in all_reduce #6 on default_pg during train (epoch 2)" in line, line
    assert "rank 1 in all_reduce #1 on demo_side during sync/param_sync (epoch 2), not in its plan" in line, line
    code = main(["replay", str(tmp_path), "--json", "--perfetto", str(tmp_path / "timeline.json")])
    out, _ = capfd.readouterr()
    report = json.loads(out)["flight_recorder"]  # found beside the traces without the flag
    assert code == 3 and report["mismatch"] and report["line"] == line.removeprefix("flight recorder: ")
    timeline = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    slices = [e["name"] for e in timeline if e.get("cat") == "collective"]
    assert sorted(slices) == ["all_reduce #1 (demo_side)", "all_reduce #6 (default_pg)", "all_reduce #6 (default_pg)"]
    # torch's own format alone (the lifecycle writes it beside the JSON): the steps as above, and torch's verdicts
    native = tmp_path / "native"
    native.mkdir()
    for dump in tmp_path.glob(f"{fr.NATIVE_PREFIX}*"):
        shutil.copy(dump, native)
    code = main(["replay", str(tmp_path), "--json", "--flight-recorder", str(native)])
    report = json.loads(capfd.readouterr()[0])["flight_recorder"]
    assert code == 3 and [r["where"] for r in report["ranks"]][::2] == ["train", "train"], report["ranks"]
    assert [(g["desc"], g["kind"], g["missing"]) for g in report["groups"] if g["kind"]] == [
        ("default_pg", "NOT_ALL_RANKS_JOINING", [1]), ("demo_side", "NOT_ALL_RANKS_JOINING", [0, 2])]


def test_replay_refuses_an_unreadable_flight_recorder_folder(tmp_path, capfd):
    """--flight-recorder on a folder that is not there is bad input (exit 2) with one line, no traceback."""
    (tmp_path / "rank-0.jsonl").write_text("")
    code = main(["replay", str(tmp_path), "--flight-recorder", str(tmp_path / "nowhere")])
    _, err = capfd.readouterr()
    assert code == 2 and "Traceback" not in err
    nowhere = tmp_path / "nowhere"
    assert err.strip().splitlines() == [f"miles-fsm replay: cannot read the Flight Recorder dump {nowhere}: not a "
                                        "directory. Pass the folder of the dumps the run wrote (fr-rank-<r>.json, "
                                        "or torch's own <prefix><rank>)"]

