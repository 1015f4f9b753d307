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
