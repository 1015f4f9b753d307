"""Replay's verdicts stay with their evidence: a transition abandoned before its guard is no attempt, a
symmetric verification failure names nobody, and headlines say what the records say and no more.
"""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
from test_aio import GatedTrainer
from toy import ToyEngine

from miles_fsm.apps.cli import main
from miles_fsm.config import GuardConfig, LifecycleConfig
from miles_fsm.launch.local import RankContext, run_ranks
from miles_fsm.states import State, Strategy
from miles_fsm.states.aio import AsyncLifecycle
from miles_fsm.states.errors import VerificationError
from miles_fsm.states.lifecycle import Lifecycle


def as_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", *argv, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


async def _offload_retried(alc: AsyncLifecycle, trainer: GatedTrainer, rank: int) -> dict[str, Any]:
    await alc.advance_to(State.TRAINING)
    await alc.advance_to(State.OFFLOADED)  # epoch 1: a whole cycle
    await alc.advance_to(State.TRAINING)
    cancelled = False
    if rank == 1:
        # The user's own deadline expires while offload plans (before its guard): anyio cancels it, and the
        # loop fires offload again.
        trainer.arm("plan", hold_s=0.5)
        with anyio.move_on_after(0.1) as scope:
            await alc.offload()
        cancelled = scope.cancelled_caught
    await alc.offload()
    await alc.advance_to(State.TRAINING)
    return {"cancelled": cancelled, "state": alc.state.value}


def offload_retried(ctx: RankContext) -> dict[str, Any]:
    """Rank 1's offload of epoch 2 times out (anyio) before its guard and is fired again; rank 0 fires it once."""
    trainer = GatedTrainer()
    config = LifecycleConfig(guard=GuardConfig(timeout_s=10.0), trace_dir=ctx.kwargs["trace_dir"])
    with Lifecycle(trainer=trainer, engine=ToyEngine(), config=config) as lc:
        return anyio.run(_offload_retried, AsyncLifecycle(lc), trainer, ctx.rank)


@pytest.mark.slow
def test_a_transition_retried_after_a_cancel_before_its_guard_replays_ok(tmp_path, capsys, assert_no_leftovers):
    """A real 2-rank anyio run: rank 1's offload (epoch 2) is cancelled by move_on_after before its guard, then
    fired again; both ranks finish healthy. The cancelled attempt entered no collective, so it is no attempt
    for alignment: replay says ok (exit 0), not divergence."""
    out = run_ranks(offload_retried, 2, timeout_s=60, kwargs={"trace_dir": str(tmp_path)})
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.result["cancelled"] for o in out] == [False, True]
    events = [orjson.loads(x)["event"] for x in (tmp_path / "rank-1.jsonl").read_bytes().splitlines()]
    assert "transition_cancelled" in events
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (0, "ok"), d["headline"]
    assert d["first_divergence"] is None


class _RestoredWrong(GatedTrainer):
    """A trainer (backup strategy) whose restore writes one tensor back wrong: ``bad`` names which."""

    def __init__(self, bad: str) -> None:
        super().__init__(strategy=Strategy.BACKUP)
        self.bad = bad

    def restore(self, tag: str):
        out = super().restore(tag)
        self.params[self.bad].add_(1.0)
        return out


def mismatch_per_rank(ctx: RankContext) -> dict[str, Any]:
    """Each rank restores the tensor ``kwargs["bad"][rank]`` wrong; resume's verification fails on each."""
    config = LifecycleConfig(guard=GuardConfig(timeout_s=10.0), trace_dir=ctx.kwargs["trace_dir"])
    error = None
    trainer = _RestoredWrong(ctx.kwargs["bad"][ctx.rank])
    with Lifecycle(trainer=trainer, engine=ToyEngine(), config=config) as lc:
        for fire in (lc.start, lc.offload, lc.pause, lc.rematerialize, lc.sync, lc.resume):
            try:
                fire()
            except VerificationError as exc:  # what the test is about: the trace holds it
                error = type(exc).__name__
                break
    return {"error": error}


@pytest.mark.slow
@pytest.mark.parametrize(("bad", "why"), [(("b", "b"), "the same"), (("b", "w"), "a different")])
def test_verification_failures_that_nothing_tells_apart_name_no_culprit(bad, why, tmp_path, capsys,
                                                                       assert_no_leftovers):
    """A real 2-rank run where both ranks fail resume's verification, with the same mismatched tensor or one
    each, and no record traces the data to a rank: replay says corrupt with the culprit undecided (both
    suspects, none named), and the headline says so in words, never blaming the higher rank."""
    out = run_ranks(mismatch_per_rank, 2, timeout_s=60, kwargs={"trace_dir": str(tmp_path), "bad": bad})
    assert [o.result["error"] for o in out if o.ok] == ["VerificationError", "VerificationError"], out
    code, d = as_json(capsys, str(tmp_path))
    assert (code, d["verdict"]) == (3, "corrupt"), d["headline"]
    assert d["culprit"]["ranks"] == [] and d["culprit"]["decided"] is False and d["culprit"]["suspects"] == [0, 1]
    assert "undecided" in d["headline"], d["headline"]


def _report(capsys, trace_dir) -> tuple[int, str]:
    code = main(["replay", str(trace_dir)])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_a_rank_that_raised_in_its_own_loop_failed_there_and_every_epoch_agrees(tmp_path, capsys,
                                                                                assert_no_leftovers):
    """A real 3-rank run: rank 1's own loop raises ValueError after epoch 1 (outside any transition), which
    closes its trace; the others lose it at offload's guard of epoch 2. The report says rank 1 raised, where,
    and that it left: FAILED, not CRASHED (the JSON verdict stays crashed), no phrase said twice; each
    transition is named with its own epoch (the survivors' guard of offload, epoch 2, on their Ranks line too;
    rank 1 finished resume of epoch 1 and never started offload of epoch 2); "lost" agrees with the count."""
    from ranks_verdicts import one_raises_in_its_loop

    out = run_ranks(one_raises_in_its_loop, 3, timeout_s=60, kwargs={"trace_dir": str(tmp_path), "bad": 1,
                                                                     "guard_timeout_s": 3.0})
    assert [o.result["error"] for o in out] == ["PeerLostError", "bad batch: 3 rows have no tokens", "PeerLostError"]
    code, text = _report(capsys, tmp_path)
    head = text.splitlines()[0]
    assert code == 3
    assert head.startswith("FAILED: rank 1 raised ValueError outside the lifecycle's transitions (epoch 1)"), head
    assert "left the run" in head and "bad batch" in head and "outside any transition" not in head
    assert "crash" not in head.lower()
    assert "PeerLostError in guard of offload (epoch 2)" in text  # the Ranks line, as the guard failure says
    assert "offload (epoch 2): PeerLostError" in text
    assert "it finished resume (epoch 1) and never started offload (epoch 2)" in text
    assert "ranks 0, 2 lost their connection" in text
    code, d = as_json(capsys, str(tmp_path))
    assert (d["verdict"], d["culprit"]["ranks"]) == ("crashed", [1])


@pytest.mark.slow
def test_a_live_run_replayed_mid_way_singles_out_nobody(tmp_path, capsys, assert_no_leftovers):
    """A real, healthy 3-rank run copied while ranks 0-1 wait at offload's guard for rank 2 (still in its train
    step): replay says nothing has failed, names no culprit and no suspect, never calls rank 2 silent or
    stuck, and its verbs agree with the count ("ranks 0-1 are waiting")."""
    from ranks_verdicts import snapshot_while_peers_wait

    snap = tmp_path / "snapshot"
    out = run_ranks(snapshot_while_peers_wait, 3, timeout_s=60,
                    kwargs={"trace_dir": str(tmp_path / "run"), "slow": 2, "snapshot": str(snap)})
    assert all(o.ok for o in out), [o.error for o in out]
    code, text = _report(capsys, snap)
    head = text.splitlines()[0]
    assert head.startswith("INCOMPLETE: no rank has failed yet"), head
    assert "ranks 0-1 are waiting at a guard for rank 2" in head and "never started offload (epoch 2)" in head
    assert "culprit: none" in text and "is silent" not in text and "stuck" not in head and "None" not in text
    code, d = as_json(capsys, str(snap))
    assert (d["verdict"], d["culprit"]["ranks"], d["culprit"]["suspects"]) == ("incomplete", [], [])


def test_a_rank_file_with_no_record_yet_is_said_so(tmp_path, capsys):
    """A live run caught while one rank's file is still empty (created, nothing written): the headline says
    that rank has no readable record yet, never "after None"."""
    from trace_writer import healthy

    healthy(tmp_path, world=2, cycles=1)
    (tmp_path / "rank-2.jsonl").write_bytes(b"")
    code, text = _report(capsys, tmp_path)
    assert code == 3 and "None" not in text.splitlines()[0], text.splitlines()[0]


def test_an_undeclared_collective_the_audit_caught_is_no_hang_and_no_crash(demo_runs, capsys):
    """The demo's undeclared collective with the plan audit on (2 ranks): rank 0 raised
    UndeclaredCollectiveError, nothing waited on it. The report reads FAILED (not CRASHED), and the Flight
    Recorder's note does not call the collective the cause of a hang."""
    run = demo_runs.get(ranks=2, steps=2, guard_s=3.0, inject=("undeclared:0:2",))
    assert run.result is not None and not run.result.ok, run.out + run.err
    code, text = _report(capsys, run.trace_dir)
    assert code == 3 and text.startswith("FAILED: rank 0 failed in "), text.splitlines()[0]
    assert "UndeclaredCollectiveError" in text.splitlines()[0]
    assert "did not declare" in text and "cause of the hang" not in text


def test_a_sigkilled_rank_crashed_and_a_single_peer_lost_its_connection(demo_runs, capsys):
    """The demo's crash (SIGKILL inside param_sync) on 2 ranks: the report still reads CRASHED, and its words
    agree with one peer ("rank 0 lost its connection")."""
    run = demo_runs.get(ranks=2, steps=2, guard_s=3.0, inject=("crash:1:2",))
    assert run.result is not None and not run.result.ok, run.out + run.err
    code, text = _report(capsys, run.trace_dir)
    assert code == 3 and text.startswith("CRASHED: rank 1 crashed"), text.splitlines()[0]
    assert "rank 0 lost its connection to it" in text and "lost their" not in text
