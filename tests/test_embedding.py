"""Embedding as frameworks do: the host's own groups, several lifecycles per job, drivers checked at once."""

from __future__ import annotations

import orjson
import pytest

import ranks_engine
from miles_fsm import DriverProtocolError, Lifecycle, LifecycleConfig, State
from miles_fsm.launch.local import run_ranks
from toy import ToyEngine, ToyTrainer


@pytest.mark.slow
def test_two_lifecycles_over_the_hosts_gloo_group_do_not_collide(tmp_path, assert_no_leftovers):
    """actor and ref, each guarded over the host's gloo group, run 2 cycles on 2 ranks while the host
    destroys and rebuilds another group: each keeps its own store keys and its own trace folder."""
    out = run_ranks(ranks_engine.host_groups, 2, timeout_s=60, kwargs={"trace_dir": str(tmp_path)})
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        assert {n: (r["state"], r["epoch"]) for n, r in o.result.items()} == {
            "actor": ("TRAINING", 2), "ref": ("TRAINING", 2)}  # fmt: skip
        assert o.result["actor"]["keys"] != o.result["ref"]["keys"]
    for name in ("actor", "ref"):
        for r in range(2):
            records = [orjson.loads(x) for x in (tmp_path / name / f"rank-{r}.jsonl").read_bytes().splitlines()]
            assert records[0]["lifecycle"] == name and records[-1]["event"] == "trace_closed"
            assert len({x["run"] for x in records}) == 1
    assert not list(tmp_path.glob("rank-*.jsonl"))  # nothing written where another lifecycle would overwrite it


@pytest.mark.slow
def test_a_divergence_in_one_lifecycle_leaves_the_other_alone(assert_no_leftovers):
    """Rank 1's ref lifecycle plans another tensor set: ref's guard fails on all 3 ranks (at its first guard
    nothing singles rank 1 out, so every rank of the differing groups is a suspect), and actor, guarded by
    its own keys and group, is untouched."""
    out = run_ranks(ranks_engine.frozen_on_second_lifecycle, 3, timeout_s=60)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        assert o.result["actor"] == "TRAINING"
        assert o.result["ref_error"] == "RankDivergenceError" and o.result["culprits"] == [0, 1, 2]


def test_a_driver_missing_protocol_members_is_refused_at_construction():
    """A trainer without tensor_set and collectives, or an engine without weight_digests, is refused when the
    Lifecycle is built, naming every missing member; nothing runs."""

    from miles_fsm import Strategy

    members = {k: getattr(ToyTrainer, k) for k in dir(ToyTrainer) if not k.startswith("_")}
    members.update(strategy=Strategy.BACKUP)
    del_trainer = type("NoCollectives", (), {k: v for k, v in members.items() if k not in ("collectives", "tensor_set")})
    with pytest.raises(DriverProtocolError, match=r"trainer driver NoCollectives lacks 2 member\(s\) of "
                                                  r"TrainerDriver: collectives, tensor_set"):  # fmt: skip
        Lifecycle(trainer=del_trainer())
    engine = type("NoDigests", (), {k: getattr(ToyEngine, k) for k in dir(ToyEngine)
                                    if not k.startswith("_") and k != "weight_digests"})
    with pytest.raises(DriverProtocolError, match="engine driver NoDigests lacks 1 member.*weight_digests"):
        Lifecycle(trainer=ToyTrainer(), engine=engine())


def test_a_trace_sink_of_your_own_receives_every_record():
    """sink= replaces the file tracer: it gets trace_opened (with the machine's table) and every record,
    and the failure keeps the state it left."""

    class ListSink:
        enabled = True

        def __init__(self) -> None:
            self.records: list[tuple[str, dict]] = []

        def emit(self, event, **fields):
            self.records.append((event, fields))

        def close(self, **fields):
            self.records.append(("trace_closed", fields))

    sink = ListSink()
    trainer = ToyTrainer()
    with Lifecycle(trainer=trainer, config=LifecycleConfig(run_id="r1"), sink=sink) as lc:
        lc.start()
        trainer.fail_on = "backup:actor"
        with pytest.raises(RuntimeError):
            lc.offload()
    events = [e for e, _ in sink.records]
    assert events[0] == "trace_opened" and sink.records[0][1]["run"] == "r1" and "machine" in sink.records[0][1]
    assert "transition_failed" in events and events[-1] == "trace_closed"
    assert lc.failure is not None and lc.failure.source is State.TRAINING


@pytest.mark.slow
@pytest.mark.parametrize("fail_push", [False, True])
def test_one_rank_calls_the_engine_and_every_rank_shares_the_outcome(fail_push, assert_no_leftovers):
    """engine_leader: only rank 0 calls the engine; both ranks run the cycle. When rank 0's push fails, rank 1
    fails in the same step with PeerStepFailedError naming rank 0, instead of waiting at the next guard."""
    out = run_ranks(ranks_engine.engine_leader, 2, timeout_s=60, kwargs={"fail_push": fail_push})
    leader, follower = (o.result for o in out)
    assert follower["engine_calls"] == []  # never called its engine
    if not fail_push:
        assert leader["state"] == follower["state"] == "TRAINING" and "update" in leader["engine_calls"]
        return
    assert leader["state"] == follower["state"] == "FAILED"
    assert leader["failed_in"] == follower["failed_in"] == "engine.push_weights"
    assert leader["error"] == {"type": "RuntimeError"}
    assert follower["error"] == {"type": "PeerStepFailedError", "ranks": [0]}


def test_several_ranks_in_the_environment_without_a_process_group_is_an_error(monkeypatch):
    """WORLD_SIZE=2 but no init_process_group: building a Lifecycle raises ProcessGroupMissingError (it used to
    run alone, its guards checking nothing and its trace claiming rank 0); Guard.solo() runs one rank on purpose."""
    from miles_fsm import Guard
    from miles_fsm.errors import ProcessGroupMissingError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ProcessGroupMissingError, match=r"WORLD_SIZE=2 \(RANK=1\)") as info:
        Lifecycle(trainer=ToyTrainer())
    assert info.value.world_size == 2
    assert Lifecycle(trainer=ToyTrainer(), guard=Guard.solo()).world == 1
