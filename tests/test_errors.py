"""Errors carry their facts as fields, traces record them, and they cross process boundaries as themselves."""

from __future__ import annotations

import pickle

import pytest

import miles_fsm.apps.errors as app_errors
import miles_fsm.drivers.errors as driver_errors
import miles_fsm.errors as engine_errors
import miles_fsm.flight_recorder as flight_recorder
import miles_fsm.launch.local as launch
import miles_fsm.replay.fr_budget as fr_budget
import miles_fsm.replay.fr_native as fr_native
import miles_fsm.replay.model as replay_model
import miles_fsm.replay.outputs as outputs
import miles_fsm.replay.runs as replay_runs
import miles_fsm.states.errors as state_errors
from miles_fsm.errors import LastSeen, MilesFsmError, describe, plain

_SEEN = LastSeen(rank=1, epoch=2, trigger="sync", state="REMATERIALIZED", phase="entered guard of", wall=1.0)

SAMPLES = [
    engine_errors.DefinitionError(["state X is a trap"]),
    engine_errors.TransitionNotAllowed("PAUSED", "offload", ["rematerialize"], RuntimeError("earlier")),
    engine_errors.TransitionCancelled("sync", 3),
    engine_errors.RankDivergenceError(epoch=2, trigger="sync", field="tensor set", groups={"a": [0, 1], "b": [2]},
                                      detail="ranks [2] lack w"),  # fmt: skip
    engine_errors.GuardTimeoutError(epoch=2, trigger="sync", missing=[1], last_seen={1: _SEEN}, timeout_s=5.0),
    engine_errors.PeerLostError(epoch=2, trigger="sync", missing=[1], last_seen={1: None}, cause="reset"),
    engine_errors.PeerNeverJoinedError(missing=[1], timeout_s=10.0, name="actor"),
    engine_errors.PeerFailedError(epoch=2, trigger="sync", failed={1: LastSeen(
        rank=1, epoch=2, trigger="rematerialize", state="PAUSED", phase="failed in cast_main_to_params of", wall=1.0,
        step="cast_main_to_params", error="RuntimeError")}),
    engine_errors.ConfigError(["a", "b"], "GuardConfig"),
    engine_errors.PeerStepFailedError(epoch=1, trigger="pause", step="engine.push_weights", ranks=[0],
                                      errors={0: "RuntimeError: refused"}),  # fmt: skip
    engine_errors.ProcessGroupMissingError(world_size=2, rank="1"),
    state_errors.RecoveryError(target="TRAINING", reason="tags gone"),
    state_errors.UndeclaredCollectiveError(rank=1, epoch=2, trigger="sync", step="trainer.param_sync",
                                           collective="all_reduce #6 on pg default_pg [1]",
                                           declared=["all_gather@dp[64:bfloat16]"]),  # fmt: skip
    flight_recorder.FlightRecorderError(path="fr/fr-rank-0.json", reason="no 'entries' list"),
    fr_native.UnsafeDumpError(path="fr/nccl_trace_rank_0", name="posix.system"),
    fr_budget.DumpBudgetError(path="fr/nccl_trace_rank_0", limit="16 levels of nesting", found="values nested 17 deep"),
    engine_errors.MemoryReleasedError(owner="trainer", op="hash", tags=["param_buffer"]),
    driver_errors.MissingDependencyError(package="httpx", extra="sglang-http", needed_for="the HTTP transport"),
    engine_errors.RankFailedError(rank=0, waiting_for="PAUSED", trigger="offload", epoch=1, step="backup(actor)",
                                  cause="RuntimeError: x"),  # fmt: skip
    state_errors.VerificationError(epoch=1, mismatched=["w"]),
    state_errors.TensorSetChangedError(epoch=1, added=["x"], removed=["y"]),
    state_errors.MemoryTagError(side="trainer", tag="default", op="pause", paused=["default"]),
    state_errors.WeightVersionError(engine="e0", expected="2", actual="1"),
    state_errors.StructureVersionError(driver="MyTrainer", version="3", added=["w[2]:float32"], removed=["w[1]:float32"]),
    state_errors.DriverProtocolError(role="trainer", driver="MyTrainer", missing=["tensor_set"], protocol="TrainerDriver"),
    driver_errors.IneligibleModelError(["frozen.weight"], "not in a DDP buffer", ["unfreeze it"]),
    driver_errors.UnsupportedVersionError(package="megatron-core", found="0.19.2", supported="0.16.x",
                                          needed_for="megatron on CPU"),  # fmt: skip
    driver_errors.CudaAvailableError(devices=1, needed_for="megatron on CPU"),
    driver_errors.EngineRequestError(engine="e0", op="flush_cache", status=400, message="busy"),
    driver_errors.EngineSessionError(engine="e0", op="begin", detail="open"),
    driver_errors.EngineUpdateError(engine="e0", op="update", status=500, message="boom", closed=["e1"],
                                    left_open=["e0"]),  # fmt: skip
    driver_errors.HostCopyMissingError(tag="ref", held=["actor"]),
    driver_errors.BufferRoutingError(buffer="param_data", expected=["param_buffer"], detail="not routed"),
    driver_errors.ResumeMemoryError(owner="tms", tag="default", needed=10, free=1),
    driver_errors.WeightChecksumError(engine="e0", against="the pushed tensors", mismatched=["w"], missing=["b"]),
    driver_errors.NotLlamaShapedError(problems=["its embeddings are tied"], source="GPTModel"),
    driver_errors.WeightLayoutError(side="HF", unknown=["x"], missing=["lm_head.weight"], mismatched=["w (2,) != (3,)"]),
    state_errors.MemoryDriftError(rank=1, tag="actor", state="PAUSED", first_cycle=3, bytes_per_cycle=4 << 20,
                                  slope=4.1e6, kind="host", grown=8 << 20),
    app_errors.FaultLocatedError(rank=0, culprits=[1], evidence="its pid is gone", cause="PeerLostError"),
    app_errors.TraceDirUnusableError(path="/ro/traces", reason="Read-only file system"),
    launch.LauncherLostError(rank=1, launcher_pid=4242),
    launch.RankStoppedError(rank=1, reason="peer_failed", failed=[0]),
    launch.RankSignalledError(rank=1, signal="SIGTERM"),
    engine_errors.RankRaisedError(rank=1, type_name="OSError", message="socket closed", traceback_text="Traceback ..."),
    replay_model.TraceDirError("traces/", "holds no rank-*.jsonl"),
    replay_runs.MixedRunsError("traces/", {"a": ["rank-0.jsonl"], "b": ["rank-1.jsonl"]}, ["rank 1"]),
    outputs.OutputPathError("traces/rank-0.jsonl", "would overwrite the run's evidence"),
]


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_error_class_has_a_sample():
    """The samples below cover every concrete MilesFsmError, so a new class is checked too."""
    abstract = {engine_errors.GuardError}
    ours = {c for c in _subclasses(MilesFsmError) if c.__module__.startswith("miles_fsm")}  # not tests' own
    assert {type(e) for e in SAMPLES} == ours - abstract


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_fields_and_notes(exc):
    """A pickled error comes back as its own class, with the same fields, message and notes (Ray, multiprocessing)."""
    exc.add_note("miles-fsm: rank 0 is now FAILED")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert plain(back.fields()) == plain(exc.fields())
    assert back.__notes__ == exc.__notes__


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_fields_are_the_constructor_keywords_and_json_ready(exc):
    """fields() names exactly the facts the constructor takes; describe() makes them JSON for traces."""
    import orjson

    assert exc.fields() and all(hasattr(exc, name) for name in exc.fields())
    record = describe(exc)
    assert record["error"] == type(exc).__name__ and record["message"] == str(exc)
    assert orjson.loads(orjson.dumps(record))["fields"] == record["fields"]


def test_errors_that_are_not_ours_say_what_kind_of_transport_failure_they_are():
    """A collective's own error is classified once by the writer: lost peer, timeout, or neither."""
    assert describe(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))["transport"] == "peer_lost"
    assert describe(RuntimeError("Timed out waiting 5000ms for recv"))["transport"] == "timeout"
    assert describe(ConnectionResetError())["transport"] == "peer_lost"
    assert describe(ValueError("bad shape"))["transport"] is None
