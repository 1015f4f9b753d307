"""The consensus guard in real multi-process gloo groups."""

from __future__ import annotations

import time

import pytest

import ranks_engine
from miles_fsm.launch.local import run_ranks

pytestmark = pytest.mark.slow


def test_agreeing_ranks_pass_the_guard_and_run(assert_no_leftovers):
    """a. Ranks that agree pass every guard and complete their cycles with identical params."""
    out = run_ranks(ranks_engine.cycles, 3, timeout_s=60, kwargs={"cycles": 2})
    assert all(o.ok for o in out), [o.error for o in out]
    assert {o.result["state"] for o in out} == {"TRAINING"}
    assert {o.result["epoch"] for o in out} == {2}
    assert len({o.result["w"] for o in out}) == 1
    assert all(o.result["calls"].count("param_sync") == 2 for o in out)


@pytest.mark.parametrize("frozen", ["b", "w"])
@pytest.mark.parametrize(("every_transition", "caught_at"), [(True, "start (epoch 0)"), (False, "sync (epoch 1)")])
def test_one_rank_with_another_tensor_set_fails_every_rank_before_the_collective(
    frozen, every_transition, caught_at, assert_no_leftovers
):
    """b. A rank that alone treats a param as frozen makes every rank raise RankDivergenceError,
    showing it and the tensor, and no rank enters the param all-gather. Guarding every transition
    (the default) catches it at the first one; guarding only collectives, at the first sync. With no
    earlier agreement, being alone is no evidence (two ranks sharing a bug would make the healthy
    one alone): the error suspects every rank of the differing groups and says it is undecided."""
    kwargs = {"frozen": {2: [frozen]}, "every_transition": every_transition}
    out = run_ranks(ranks_engine.cycles, 3, timeout_s=60, kwargs=kwargs)
    for o in out:
        assert o.error is not None and o.error.type == "RankDivergenceError", o
        assert (o.error.attrs["culprits"], o.error.attrs["how"]) == ((0, 1, 2), "undecided")
        assert "Undecided" in o.error.message
        assert o.error.attrs["field"] == "tensor set"
        assert f"ranks [2] lack {frozen}" in o.error.message
        assert o.exitcode == 1
    # The guard failed before the transition's first step, so no rank ever called param_sync.
    # (Each rank's calls are lost with its process; the trace would show them.)
    assert all(f"before {caught_at}" in o.error.message for o in out)


def test_divergence_never_enters_the_collective(tmp_path, assert_no_leftovers):
    """b. The traces prove it: no rank started the param_sync action in the diverged transition."""
    import orjson

    out = run_ranks(
        ranks_engine.cycles, 2, timeout_s=60, kwargs={"frozen": {1: ["b"]}, "trace_dir": str(tmp_path)}
    )
    assert all(o.error is not None and o.error.type == "RankDivergenceError" for o in out)
    for r in range(2):
        records = [orjson.loads(line) for line in (tmp_path / f"rank-{r}.jsonl").read_bytes().splitlines()]
        started = [x for x in records if x["event"] == "action_started" and x["trigger"] == "sync"]
        assert started == []
        assert records[-1]["event"] == "transition_failed"
        assert records[-1]["phase"] == "guard"


def test_a_rank_that_never_arrives_is_named_within_the_timeout(assert_no_leftovers):
    """c. A rank stuck before its guard makes the others raise GuardTimeoutError naming it,
    within timeout + 2 s."""
    timeout = 3.0
    t0 = time.monotonic()
    out = run_ranks(
        ranks_engine.cycles, 3, timeout_s=60, linger_s=timeout + 2, kwargs={"hang_rank": 1, "timeout_s": timeout}
    )
    survivors = [o for o in out if o.rank != 1]
    for o in survivors:
        assert o.error is not None and o.error.type == "GuardTimeoutError", o
        assert o.error.attrs["missing"] == (1,)
        assert o.elapsed_s is not None and o.elapsed_s < timeout + 2 + 2.0  # + startup of the first cycle
    assert out[1].result is None  # the hung rank was killed, not finished
    assert time.monotonic() - t0 < 30


def test_a_trigger_of_its_own_timeout_waits_that_long_and_no_longer(assert_no_leftovers):
    """GuardConfig.timeouts: sync's guard waits 1 s for the hung rank (not the 30 s default) and names it,
    with the 1 s in the error."""
    out = run_ranks(
        ranks_engine.cycles, 2, timeout_s=60, linger_s=4,
        kwargs={"hang_rank": 1, "timeout_s": 30.0, "timeouts": {"sync": 1.0}},
    )  # fmt: skip
    survivor = out[0]
    assert survivor.error is not None and survivor.error.type == "GuardTimeoutError", survivor
    assert survivor.error.attrs["missing"] == (1,) and survivor.error.attrs["timeout_s"] == 1.0
    assert "within 1 s" in survivor.error.message
    assert survivor.elapsed_s is not None and survivor.elapsed_s < 1.0 + 2 + 2.0


def test_illegal_trigger_changes_nothing(assert_no_leftovers):
    """d. An illegal trigger raises TransitionNotAllowed and changes neither state nor driver."""
    out = run_ranks(ranks_engine.illegal, 2, timeout_s=60)
    for o in out:
        assert o.ok, o.error
        assert o.result == {"state": "TRAINING", "exc_state": "TRAINING", "trigger": "sync", "same_calls": True}


def test_failing_step_lands_in_failed(assert_no_leftovers):
    """e. A step that raises moves the rank to FAILED with the cause kept; FAILED refuses triggers."""
    out = run_ranks(ranks_engine.failing_step, 2, timeout_s=60)
    for o in out:
        assert o.ok, o.error
        r = o.result
        assert r["error"] == "injected failure in cast_main_to_params"
        assert r["state"] == "FAILED"
        assert r["failure_step"] == "cast_main_to_params"
        assert r["refused"] == "TransitionNotAllowed"


def test_double_pause_is_refused(assert_no_leftovers):
    """f. Pausing an already paused tag raises MemoryTagError and sends nothing to the driver."""
    out = run_ranks(ranks_engine.double_pause, 2, timeout_s=60)
    for o in out:
        assert o.ok, o.error
        assert o.result == {"error": "MemoryTagError", "tag": "default", "new_calls": []}


def test_train_step_guard_catches_a_different_collective_plan(assert_no_leftovers):
    """Lifecycle.agree_on guards a step outside the lifecycle: a rank planning another
    reduce-scatter size fails every rank on the collective plan, and the state stays TRAINING. At this
    first train guard no earlier agreement singles it out: every rank of the differing groups is a suspect."""
    out = run_ranks(ranks_engine.train_guard, 3, timeout_s=60, kwargs={"odd_rank": 0})
    for o in out:
        assert o.ok, o.error
        assert o.result == {"error": "RankDivergenceError", "field": "collective plan", "culprits": (0, 1, 2),
                            "state": "TRAINING"}  # fmt: skip
    agreeing = run_ranks(ranks_engine.train_guard, 2, timeout_s=60)
    assert [o.result for o in agreeing] == [{"error": None, "state": "TRAINING"}] * 2
