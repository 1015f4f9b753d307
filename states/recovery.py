"""The recovery rule: leaving FAILED only to a state whose memory is really there.

``Lifecycle.recover`` asks these checks, in order, before it touches memory:
the target is a cycle state (``check_target``), no trainer tag it needs is
released (``check_target``), and the failed transition left no params
unbuilt or unverified on the way back (``check_rebuilt``). Then
``match_memory`` releases or resumes tags to the target's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from miles_fsm.machine import Failure, PlannedStep
from miles_fsm.states.definition import DEFINITION, Side, State, Step, StepKind
from miles_fsm.states.errors import RecoveryError
from miles_fsm.states.memory import MemoryLedger

__all__ = ["check_rebuilt", "check_target", "match_memory", "rebuilds"]


def check_target(state: State, target: State, trainer: MemoryLedger) -> None:
    """Refuse leaving a state other than FAILED, a target outside the cycle, or one needing lost trainer tags."""
    if state is not State.FAILED:
        raise RecoveryError(target=target.value, reason=f"the rank is {state.value}, not FAILED")
    if not target.in_cycle:
        raise RecoveryError(target=target.value, reason="only the five cycle states can be recovered to")
    lost = sorted(trainer.paused - target.trainer_paused_tags)
    if lost:
        raise RecoveryError(
            target=target.value,
            reason=f"trainer tags {lost} are released and their contents are gone; "
            "recover to PAUSED and rematerialize, or reload them first",
        )


def check_rebuilt(failure: Failure | None, planned: Sequence[PlannedStep], trainer: MemoryLedger, target: State,
                  pending: int | None) -> None:  # fmt: skip
    """Refuse a target that would train on params the failed transition left unbuilt or unverified.

    A failure at or after a rebuilding step (a trainer resume, the cast,
    a restore, the param sync, the verification) leaves the params'
    bytes undefined or known bad. The target must then re-run the
    failed transition on its way back to TRAINING, and hold released
    every tag that was resumed without being rebuilt. ``planned``: the
    failed trigger's steps; ``pending``: the epoch whose verification is
    pending, if any.
    """
    if failure is None or failure.step is None:
        return  # the guard failed: no step ran
    names = [p.name for p in planned]
    if failure.step not in names:
        return
    ran = planned[: names.index(failure.step) + 1]
    if not any(rebuilds(p.step) for p in ran):
        return
    resumed = {tag for p in ran if p.step.kind is StepKind.RESUME_MEMORY and p.step.side is Side.TRAINER
               for tag in p.step.tags}  # fmt: skip
    unbuilt = sorted((resumed - trainer.paused) - target.trainer_paused_tags)
    reruns = failure.trigger in (DEFINITION.path(target, State.TRAINING) or ())
    if unbuilt or not reruns:
        why = (f"trainer tags {unbuilt} were resumed but not rebuilt" if unbuilt else
               f"the params' bytes are {'known bad' if ran[-1].step.kind is StepKind.VERIFY else 'not rebuilt'}")
        raise RecoveryError(
            target=target.value,
            reason=f"{failure.trigger.value} failed in {failure.step} (epoch {failure.epoch}): {why}, and "
            f"from {target.value} the way back to TRAINING would not run {failure.trigger.value} again"
            + (f" (verification of epoch {pending} is pending)" if pending is not None else "")
            + "; recover to PAUSED and rematerialize",
        )


def match_memory(target: State, memory: Mapping[Side, MemoryLedger], *, engine: bool) -> None:
    """Release (never resume) trainer tags, and release or resume engine tags, to ``target``'s."""
    trainer = memory[Side.TRAINER]
    trainer.pause(sorted(target.trainer_paused_tags - trainer.paused))
    if engine:
        ledger = memory[Side.ENGINE]
        ledger.pause(sorted(target.engine_released_tags - ledger.paused))
        ledger.resume(sorted(ledger.paused - target.engine_released_tags))


def rebuilds(step: Step) -> bool:
    """Steps after whose start the params' bytes are undefined until the transition ends."""
    if step.kind is StepKind.RESUME_MEMORY:
        return step.side is Side.TRAINER
    return step.kind in (StepKind.CAST_MAIN_TO_PARAMS, StepKind.RESTORE, StepKind.PARAM_SYNC, StepKind.VERIFY)
