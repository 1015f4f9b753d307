"""Rank functions for the engine's multi-process tests (importable by name)."""

from __future__ import annotations

import time
from typing import Any

from miles_fsm import GuardConfig, Lifecycle, LifecycleConfig, Trigger
from miles_fsm.launch.local import RankContext
from toy import ToyEngine, ToyTrainer



def build(ctx: RankContext, **trainer_kw: Any) -> tuple[Lifecycle, ToyTrainer]:
    trainer = ToyTrainer(**trainer_kw)
    config = LifecycleConfig(
        guard=GuardConfig(timeout_s=ctx.kwargs.get("timeout_s", 3.0),
                          every_transition=ctx.kwargs.get("every_transition", True),
                          timeouts=ctx.kwargs.get("timeouts", {})),
        trace_dir=ctx.kwargs.get("trace_dir"),
    )
    return Lifecycle(trainer=trainer, engine=ToyEngine(), config=config), trainer


def cycles(ctx: RankContext) -> dict[str, Any]:
    """Run whole cycles; optionally this rank freezes a param or hangs before a guard."""
    frozen = ctx.kwargs.get("frozen", {}).get(ctx.rank, ())
    lc, trainer = build(ctx, frozen=frozen)
    lc.start()
    hang = ctx.kwargs.get("hang_rank") == ctx.rank

    def stall() -> None:
        if hang:
            time.sleep(3600)

    for _ in range(ctx.kwargs.get("cycles", 2)):
        for t in lc.cycle:
            lc.fire(t, before_guard=stall if t is Trigger.SYNC else None)
    return {"calls": trainer.calls, "state": lc.state.value, "epoch": lc.epoch, "w": trainer.params["w"].float().sum().item()}


def failing_step(ctx: RankContext) -> dict[str, Any]:
    """Every rank's rematerialize cast fails; report what the machine says afterwards."""
    lc, trainer = build(ctx)
    lc.start()
    lc.offload()
    lc.pause()
    trainer.fail_on = "cast_main_to_params"
    try:
        lc.rematerialize()
    except RuntimeError as exc:
        err = str(exc)
    else:  # pragma: no cover - the test asserts on this
        err = None
    refused = None
    try:
        lc.sync()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        refused = type(exc).__name__
    failure = lc.failure
    return {
        "error": err,
        "state": lc.state.value,
        "failure_step": failure.step if failure else None,
        "refused": refused,
        "paused": sorted(lc.paused_tags[next(iter(lc.paused_tags))]),
    }


def double_pause(ctx: RankContext) -> dict[str, Any]:
    """A second pause of a paused trainer tag is refused and never reaches the driver."""
    from miles_fsm.states import Side
    from miles_fsm.states.errors import MemoryTagError

    lc, trainer = build(ctx)
    lc.start()
    lc.offload()
    before = list(trainer.calls)
    ledger = lc._actions.memory[Side.TRAINER]  # the ledger the machine uses; exercised directly here
    try:
        ledger.pause(["default"])
    except MemoryTagError as exc:
        return {"error": type(exc).__name__, "tag": exc.tag, "new_calls": trainer.calls[len(before):]}
    return {"error": None}


def illegal(ctx: RankContext) -> dict[str, Any]:
    """An illegal trigger raises and changes nothing, on every rank."""
    from miles_fsm import TransitionNotAllowed

    lc, trainer = build(ctx)
    lc.start()
    calls = list(trainer.calls)
    try:
        lc.fire(Trigger.SYNC)
    except TransitionNotAllowed as exc:
        return {"state": lc.state.value, "exc_state": exc.state, "trigger": exc.trigger, "same_calls": calls == trainer.calls}
    return {"state": lc.state.value, "exc_state": None}


def train_guard(ctx: RankContext) -> dict[str, Any]:
    """Guard a train step whose all-reduce size differs on one rank; report the outcome."""
    from miles_fsm.errors import RankDivergenceError
    from miles_fsm.plan import Collective

    lc, _ = build(ctx)
    lc.start()
    numel = 1000 + (1 if ctx.rank == ctx.kwargs.get("odd_rank") else 0)
    try:
        lc.agree_on("train", (Collective("reduce_scatter", "dp", "float32", numel),))
    except RankDivergenceError as exc:
        return {"error": "RankDivergenceError", "field": exc.field, "culprits": exc.culprits, "state": lc.state.value}
    return {"error": None, "state": lc.state.value}


def host_groups(ctx: RankContext) -> dict[str, Any]:
    """Two lifecycles (actor, ref) on one job, each guarded over the host's own gloo group; the host
    destroys and rebuilds another group between cycles, as frameworks do with NCCL around sleep."""
    import torch.distributed as dist

    from miles_fsm.testing import run_cycles

    host_gloo = dist.new_group(backend="gloo")
    trace_dir = ctx.kwargs["trace_dir"]
    lcs = {}
    for name in ("actor", "ref"):
        config = LifecycleConfig(guard=GuardConfig(timeout_s=5.0), trace_dir=trace_dir, name=name)
        lcs[name] = Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(), config=config, group=host_gloo)
    for lc in lcs.values():
        lc.start()
    for _ in range(2):
        scratch = dist.new_group(backend="gloo")  # stands in for the host's NCCL group
        for lc in lcs.values():
            run_cycles(lc)
        dist.destroy_process_group(scratch)
    for lc in lcs.values():
        lc.close()
    return {name: {"state": lc.state.value, "epoch": lc.epoch, "keys": lc._guard.namespace} for name, lc in lcs.items()}


def frozen_on_second_lifecycle(ctx: RankContext) -> dict[str, Any]:
    """The 'ref' lifecycle of rank 1 plans another tensor set; 'actor' is healthy on every rank."""
    actor = Lifecycle(trainer=ToyTrainer(), config=LifecycleConfig(guard=GuardConfig(timeout_s=5.0), name="actor"))
    frozen = ["b"] if ctx.rank == 1 else []
    ref = Lifecycle(trainer=ToyTrainer(frozen=frozen), config=LifecycleConfig(guard=GuardConfig(timeout_s=5.0),
                                                                                name="ref"))  # fmt: skip
    actor.start()
    try:
        ref.start()
    except Exception as exc:  # noqa: BLE001 - the test reads its type and fields
        return {"actor": actor.state.value, "ref_error": type(exc).__name__, "culprits": list(exc.culprits)}
    return {"actor": actor.state.value, "ref_error": None}


def engine_leader(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 calls the engine for both ranks; with ``fail_push`` its push fails."""
    engine = ToyEngine()
    if ctx.kwargs.get("fail_push") and ctx.rank == 0:
        def update_weights(named, *, version):  # noqa: ARG001
            raise RuntimeError("engine refused the push")

        engine.update_weights = update_weights
    config = LifecycleConfig(guard=GuardConfig(timeout_s=10.0))
    lc = Lifecycle(trainer=ToyTrainer(), engine=engine, config=config, engine_leader=ctx.rank == 0)
    lc.start()
    error = None
    try:
        lc.offload()
        lc.pause()
        lc.rematerialize(), lc.sync(), lc.resume()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the fields
        error = {"type": type(exc).__name__, **({"ranks": list(exc.ranks)} if hasattr(exc, "ranks") else {})}
    failure = lc.failure
    return {"state": lc.state.value, "engine_calls": engine.calls, "error": error,
            "failed_in": failure.step if failure else None}


def cycles_or_diverge(ctx: RankContext) -> dict[str, Any]:
    """Two verified cycles; with ``frozen_rank``, that rank plans another tensor set; with ``hang_rank``, it hangs
    before its sync guard."""
    from miles_fsm.testing import run_cycles

    frozen = ["b"] if ctx.kwargs.get("frozen_rank") == ctx.rank else []
    lc, trainer = build(ctx, frozen=frozen)
    lc.start()
    if ctx.kwargs.get("hang_rank") == ctx.rank:
        lc.offload(), lc.pause(), lc.rematerialize()
        time.sleep(3600)
    run_cycles(lc, 2)
    return {"state": lc.state.value, "epoch": lc.epoch, "w": trainer.params["w"].float().sum().item()}
