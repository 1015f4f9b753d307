"""Rank functions for the Megatron driver's tests on real megatron-core 0.16.1: CPU, gloo, two ranks.

Every rank runs only shipped code: ``miles_fsm.drivers.megatron.cpu.enable()``
(the opt-in CPU patches) and the tiny GPT of ``drivers/megatron/gpt.py``.
Nothing here patches megatron or torch to make it run (``_CollectiveLog``
only wraps the collectives, to watch what a train step issues).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

# Other test modules' rank functions build their GPT from these; all three are shipped code.
from miles_fsm.drivers.megatron.cpu import enable as apply_cpu_patches
from miles_fsm.drivers.megatron.gpt import build_tiny_gpt, train_step

__all__ = [
    "apply_cpu_patches",
    "build_tiny_gpt",
    "megatron_available",
    "rank_demo_cycles",
    "rank_full_cycles",
    "rank_structure_and_divergence",
    "train_step",
]


def megatron_available() -> str | None:
    """None if megatron-core imports, else why not (for ``pytest.skip``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as exc:
        return f"megatron-core is not importable ({exc}); install the 'test' extra on Python 3.11"
    return None


# --------------------------------------------------------------------------- rank functions
# Module-level so ``miles_fsm.launch.local.run_ranks`` can import them in each child.


def _lifecycle(driver: Any, *, guard_timeout_s: float = 30.0) -> Any:
    from miles_fsm.config import GuardConfig, LifecycleConfig
    from miles_fsm.states.lifecycle import Lifecycle

    cfg = LifecycleConfig(guard=GuardConfig(timeout_s=guard_timeout_s), verify=driver.config.verify)
    return Lifecycle(trainer=driver, config=cfg)


def _cycle(lc: Any, *, between: Any = None) -> None:
    lc.offload()
    lc.pause()
    if between is not None:
        between()
    lc.rematerialize()
    lc.sync()
    lc.resume()


def rank_full_cycles(ctx: Any) -> dict[str, Any]:
    """Full lifecycle cycles with real training between them; every cycle verified by SHA256.

    Returns what the test asserts on: digests per cycle, the saver's resident
    bytes in PAUSED, host bytes, pause-state independence of the plan, the
    ``copy`` semantics, and a negative control (no cast: verification fails).
    """
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.cpu import build_cpu_gpt_trainer
    from miles_fsm.errors import MemoryReleasedError
    from miles_fsm.states.errors import VerificationError
    from miles_fsm.states import Step, StepKind, Strategy

    strategy = Strategy(ctx.kwargs["strategy"])
    saver = CpuMemorySaver()
    driver = build_cpu_gpt_trainer(strategy=strategy, saver=saver, ci=True)
    lc = _lifecycle(driver)
    lc.start()
    out: dict[str, Any] = {"cycles": [], "paused_resident": [], "resident_training": saver.resident_bytes()}
    sync = Step(StepKind.PARAM_SYNC)
    for cycle in range(ctx.kwargs.get("cycles", 3)):
        driver.train_step(step=cycle)
        before = digest_tensors(driver.tensors())
        plan_training = (driver.tensor_set(), driver.collectives(sync))

        def in_paused() -> None:
            out["paused_resident"].append(saver.resident_bytes(["param_buffer", "grad_buffer", "default"]))
            # The plan must not read pause state: the same in PAUSED as in TRAINING.
            out.setdefault("plan_same_when_paused", []).append(
                (driver.tensor_set(), driver.collectives(sync)) == plan_training
            )
            try:
                driver.copy("actor", "old_actor")
            except MemoryReleasedError as exc:
                out["copy_refused_when_paused"] = exc.tags

        lc.offload()
        driver.copy("actor", "old_actor")
        out.setdefault("old_actor_exact", []).append(digest_tensors(dict(driver.get("old_actor"))) == before)
        lc.pause()
        in_paused()
        lc.rematerialize()
        lc.sync()
        lc.resume()
        after = digest_tensors(driver.tensors())
        out["cycles"].append({"epoch": lc.epoch, "exact": after == before, "tensors": len(after)})
    out["actor_host_bytes"] = driver.host_bytes("actor")
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in driver.tensors().values())
    out["collectives"] = [str(c) for c in driver.collectives(sync)]
    out["state"] = lc.state.value
    out["strategy"] = driver.strategy.value
    if strategy is Strategy.REMATERIALIZE:
        # Negative control: skip the cast, and the poisoned param buffer must be caught.
        driver.train_step(step=99)
        driver.cast_main_to_params = lambda: None  # type: ignore[method-assign]
        try:
            _cycle(lc)
        except VerificationError as exc:
            out["no_cast_caught"] = len(exc.mismatched)
    return out


class _CountingSync:
    """Wraps a chunk's start_param_sync to count how often the all-gather was entered."""

    def __init__(self, chunk: Any) -> None:
        self.calls = 0
        self._inner = chunk.start_param_sync
        chunk.start_param_sync = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner(*args, **kwargs)


def rank_structure_and_divergence(ctx: Any) -> dict[str, Any]:
    """Construction-time refusals, then a tensor-set divergence on rank 1 caught by the guard.

    1. A GPT with a frozen param is refused under rematerialize, naming it;
       naming it in ``extra_params``, or the backup strategy, accepts it.
    2. A config that disagrees with the megatron objects is refused, all at once.
    3. A healthy cycle, then rank 1 alone registers a new buffer: the guard of
       the SYNC transition fails on every rank before any ``start_param_sync``.
    """
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.megatron.cpu import build_cpu_gpt_trainer, enable
    from miles_fsm.drivers.megatron.gpt import GptConfig, build_tiny_gpt
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.drivers.errors import IneligibleModelError
    from miles_fsm.errors import ConfigError, RankDivergenceError
    from miles_fsm.states import Strategy

    out: dict[str, Any] = {}
    enable()
    frozen = build_tiny_gpt(GptConfig(frozen=("final_layernorm.weight",), with_extras=False))
    try:
        MegatronTrainer(chunks=frozen.chunks, optimizer=frozen.optimizer)
    except IneligibleModelError as exc:
        out["ineligible"] = list(exc.params)
        out["ineligible_message"] = str(exc)
        out["ineligible_suggestions"] = list(exc.suggestions)
    name = "module.decoder.final_layernorm.weight"
    ok = MegatronTrainer(
        chunks=frozen.chunks,
        optimizer=frozen.optimizer,
        config=MegatronDriverConfig.from_megatron(frozen.chunks, frozen.optimizer, extra_params=(name,)),
    )
    out["extra_param_backed_up"] = name in ok._extras()
    plain = build_tiny_gpt(GptConfig(with_extras=False))
    out["verified_tags"] = {
        "plain": sorted(MegatronTrainer(chunks=plain.chunks, optimizer=plain.optimizer).verified_tags or ["unknown"]),
        "frozen": sorted(ok.verified_tags or ["unknown"]),
    }
    backup = MegatronTrainer(
        chunks=frozen.chunks,
        optimizer=frozen.optimizer,
        config=MegatronDriverConfig.from_megatron(frozen.chunks, frozen.optimizer, strategy=Strategy.BACKUP),
    )
    out["backup_accepts_frozen"] = backup.strategy.value
    try:
        MegatronTrainer(
            chunks=frozen.chunks,
            optimizer=frozen.optimizer,
            config=MegatronDriverConfig(
                strategy=Strategy.BACKUP,
                use_distributed_optimizer=False,
                overlap_param_gather=True,
                extra_params=("nope",),
            ),
        )
    except ConfigError as exc:
        out["mismatch_violations"] = list(exc.violations)

    try:  # the name without the Float16Module wrapper's prefix, as a user might write it
        MegatronTrainer(
            chunks=frozen.chunks,
            optimizer=frozen.optimizer,
            config=MegatronDriverConfig.from_megatron(
                frozen.chunks, frozen.optimizer, extra_params=("decoder.final_layernorm.weight",)
            ),
        )
    except ConfigError as exc:
        out["misnamed_extra"] = list(exc.violations)

    driver = build_cpu_gpt_trainer(saver=CpuMemorySaver(), ci=True)
    out["verified_tags"]["with_buffers"] = sorted(driver.verified_tags or ["unknown"])
    counters = [_CountingSync(chunk) for chunk in driver.chunks]
    lc = _lifecycle(driver, guard_timeout_s=20.0)
    lc.start()
    driver.train_step(step=0)
    _cycle(lc)
    out["syncs_after_healthy_cycle"] = [c.calls for c in counters]
    driver.train_step(step=1)  # the optimizer's own param sync runs here, outside the lifecycle
    out["syncs_before_divergent_cycle"] = [c.calls for c in counters]

    def diverge() -> None:
        # The seed's bug in miniature: one rank's tensor set differs from the others'.
        if ctx.rank == 1:
            norm = driver.chunks[0].module.module.decoder.final_layernorm
            norm.register_buffer("stray_bias", torch.zeros(8))

    try:
        _cycle(lc, between=diverge)
    except RankDivergenceError as exc:
        out["divergence"] = {"field": exc.field, "groups": {k: list(v) for k, v in exc.groups.items()}}
    out["syncs_after_divergence"] = [c.calls for c in counters]
    out["state"] = lc.state.value
    return out


class _CollectiveLog:
    """Records every collective that crosses ranks (group size > 1) as (op, dtype, numel).

    megatron's buffers call the all-gather and reduce-scatter through module
    globals bound at import, so those are wrapped where megatron reads them.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.distributed import param_and_grad_buffer as pgb

        self.seen: list[tuple[str, str, int]] = []
        self._dist = dist
        self.on = False
        # (the full-size tensor's position, the group's position) in each signature
        pgb.dist_reduce_scatter_func = self._wrap("reduce_scatter", pgb.dist_reduce_scatter_func, 1, 3)
        pgb.dist_all_gather_func = self._wrap("all_gather", pgb.dist_all_gather_func, 0, 2)
        dist.all_reduce = self._wrap("all_reduce", dist.all_reduce, 0, 2)

    def _wrap(self, op: str, fn: Any, full: int, at: int) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[at] if len(args) > at else None)
            if self.on and self._dist.get_world_size(group) > 1:
                t = args[full]
                self.seen.append((op, str(t.dtype).removeprefix("torch."), t.numel()))
            return fn(*args, **kwargs)

        return wrapped


def rank_demo_cycles(ctx: Any) -> dict[str, Any]:
    """What ``miles-fsm demo --trainer megatron`` would run, from the shipped module alone.

    Per strategy: ``build_cpu_gpt_trainer``, a ``Lifecycle`` verifying every
    cycle (``VerifyConfig(cycles=None)``), then per cycle a train step behind
    ``agree_on("train", trainer.train_collectives())`` and one full lifecycle
    cycle. Returns, per strategy and cycle, whether the lifecycle's verify
    step ran, the test's own digest check, the trainer bytes resident while
    PAUSED, and the collectives the train step issued next to those it declared.
    """
    import hashlib

    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.megatron.cpu import build_cpu_gpt_trainer
    from miles_fsm.states.lifecycle import Lifecycle

    log = _CollectiveLog()
    out: dict[str, Any] = {}
    for strategy in ("rematerialize", "backup"):
        trainer = build_cpu_gpt_trainer(strategy=strategy)
        lc = Lifecycle(trainer=trainer, config=LifecycleConfig(guard=GuardConfig(timeout_s=30),
                                                               verify=VerifyConfig(cycles=None)))  # fmt: skip
        lc.start()
        cycles = []
        for cycle in range(2):
            lc.agree_on("train", trainer.train_collectives())
            log.on, log.seen = True, []
            loss = trainer.train_step(step=cycle)
            log.on = False
            before = digest_tensors(trainer.tensors())
            lc.offload()
            lc.pause()
            paused = trainer.saver.resident_bytes()
            lc.rematerialize()
            lc.sync()
            result = lc.resume()
            cycles.append({
                "epoch": lc.epoch,
                "loss": loss,
                "verified": "verify" in [s.name for s in result.steps],
                "exact": digest_tensors(trainer.tensors()) == before,
                "params": hashlib.sha256(repr(sorted(digest_tensors(trainer.tensors()).items())).encode()).hexdigest(),
                "paused_resident": paused,
                "default_resident": trainer.saver.resident_bytes(["default"]),
                "train_seen": list(log.seen),
                "train_declared": [(c.op, c.dtype, c.numel) for c in trainer.train_collectives()],
            })  # fmt: skip
        out[strategy] = {"cycles": cycles, "state": lc.state.value, "strategy": trainer.strategy.value}
    return out
