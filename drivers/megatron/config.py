"""The Megatron driver's configuration: the rematerialize constraints, typed.

Rematerialize keeps no host copy of the actor's bf16 params; it rebuilds them
from the fp32 master shards and an all-gather. That is only safe when the run
is set up the way the seed (miles PR #2223) requires. ``MegatronDriverConfig``
states those settings as fields and refuses, in one ``ConfigError`` listing
every violation, any combination that would make rematerialize unsafe.

``MegatronDriverConfig.from_megatron`` reads the settings megatron already
knows (distributed optimizer, overlap_param_gather, precision-aware optimizer,
optimizer CPU offload) from the live objects, so they cannot disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from miles_fsm.config import VerifyConfig, ci_mode
from miles_fsm.errors import ConfigError
from miles_fsm.states import Strategy

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["MegatronDriverConfig", "TagMemory"]

_log = logging.getLogger("miles_fsm.drivers.megatron.driver")


@dataclass(frozen=True, kw_only=True, slots=True)
class TagMemory:
    """How one trainer memory tag is allocated: whether its region keeps a host backup."""

    tag: str
    cpu_backup: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronDriverConfig:
    """Settings of one Megatron trainer driver, checked when built.

    The fields below ``strategy`` describe the RL run the driver lives in;
    they mirror miles' flags. Only ``Strategy.REMATERIALIZE`` constrains them.
    """

    strategy: Strategy = Strategy.REMATERIALIZE
    #: Engine-free debugging of the trainer alone (slime/miles' debug_train_only).
    #: Nothing is pushed, so rematerialize is turned off (and that is logged).
    train_only_debug: bool = False

    backend: str = "megatron"
    lora: bool = False
    optimizer_enabled: bool = True
    independent_dp_cells: int = 1
    colocate: bool = True
    offload_train: bool = True
    offload_target: Literal["cpu", "disk"] = "cpu"
    use_distributed_optimizer: bool = True
    keep_old_actor: bool = False
    precision_aware_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    overlap_param_gather: bool = False
    compute_advantages: bool = True
    critic_only_steps: int = 0

    #: Params outside every DDP buffer (e.g. frozen ones) that the user accepts
    #: to keep a full host copy of; rematerialize refuses any other such param.
    extra_params: tuple[str, ...] = ()
    #: SHA256 over the first N cycles (the seed's 2), None for every cycle, or ``"auto"``: every cycle
    #: where the digests are hashed on the GPU, the first 2 elsewhere (``VerifyConfig``); ``ci``
    #: verifies every cycle.
    verify_cycles: int | None | Literal["auto"] = "auto"
    ci: bool = field(default_factory=ci_mode)
    #: Pin host copies (only possible, and only useful, with CUDA tensors).
    pin_memory: bool = True
    #: Who keeps the optimizer state (``default`` tag) across a pause:
    #: ``"saver"``, torch_memory_saver's region backup (fresh host memory each
    #: pause, about 2.4 GB/s pause and 8 GB/s resume on an H200); or
    #: ``"driver"``, the driver's persistent pinned buffers at the pinned-copy
    #: limit, the tag then paused without a region backup.
    optimizer_offload: Literal["saver", "driver"] = "saver"

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        object.__setattr__(self, "extra_params", tuple(self.extra_params))
        problems = list(self._field_problems())
        if self.strategy is Strategy.REMATERIALIZE and not self.train_only_debug:
            problems.extend(self.rematerialize_violations)
        if problems:
            raise ConfigError(problems, "MegatronDriverConfig")
        if self.strategy is Strategy.REMATERIALIZE and self.train_only_debug:
            _log.warning(
                "miles-fsm: train_only_debug is set, so rematerialize is off and the backup strategy "
                "runs: with no engine push there is no reason to drop the bf16 params, and the "
                "rematerialize constraints (colocate, offload_train, ...) do not hold in debug runs"
            )

    def _field_problems(self) -> Sequence[str]:
        out = []
        if isinstance(self.verify_cycles, int) and self.verify_cycles < 0:
            out.append(f"verify_cycles must be >= 0, None or 'auto', got {self.verify_cycles}")
        if self.independent_dp_cells < 1:
            out.append(f"independent_dp_cells must be >= 1, got {self.independent_dp_cells}")
        if self.critic_only_steps < 0:
            out.append(f"critic_only_steps must be >= 0, got {self.critic_only_steps}")
        if self.optimizer_offload not in ("saver", "driver"):
            out.append(f"optimizer_offload must be 'saver' or 'driver', got {self.optimizer_offload!r}")
        if self.offload_target not in ("cpu", "disk"):
            out.append(f"offload_target must be 'cpu' or 'disk', got {self.offload_target!r}")
        return out

    @property
    def rematerialize_violations(self) -> tuple[str, ...]:
        """Every rematerialize constraint this config breaks, with what to change."""
        checks = (
            (self.backend == "megatron", f"backend must be 'megatron', got {self.backend!r}"),
            (not self.lora, "LoRA must be off: adapters are not rebuilt from the master weights"),
            (self.optimizer_enabled, "the optimizer must be enabled: the fp32 master weights live in it"),
            (
                self.independent_dp_cells <= 1,
                f"independent DP cells must be off (got {self.independent_dp_cells} cells): "
                "the param all-gather would cross cells",
            ),
            (self.colocate, "colocate must be on: without it the trainer never gives up the GPU"),
            (self.offload_train, "offload_train must be on: rematerialize is a way of offloading"),
            (
                self.offload_target == "cpu",
                f"the offload target must be 'cpu', got {self.offload_target!r}",
            ),
            (
                self.use_distributed_optimizer,
                "the distributed optimizer must be on: only it writes master shards into the param buffer",
            ),
            (not self.keep_old_actor, "keep_old_actor must be off: it needs a full copy of the actor params"),
            (
                not self.precision_aware_optimizer or self.optimizer_cpu_offload,
                "a precision-aware optimizer needs optimizer CPU offload: otherwise "
                "_copy_main_params_to_model_params() writes nothing",
            ),
            (
                not self.overlap_param_gather,
                "overlap_param_gather must be off: the param sync must be a blocking all-gather",
            ),
            (self.compute_advantages, "advantages must be computed (no reward-only/eval-only steps)"),
            (
                self.critic_only_steps <= 0,
                f"critic-only steps must be 0, got {self.critic_only_steps}: the actor is offloaded unchanged",
            ),
        )
        return tuple(msg for ok, msg in checks if not ok)

    @property
    def effective_strategy(self) -> Strategy:
        """The strategy that runs: train-only debug turns rematerialize off."""
        if self.train_only_debug:
            return Strategy.BACKUP
        return self.strategy

    @property
    def verify(self) -> VerifyConfig:
        """The lifecycle's SHA256 verification: every cycle under CI, else as ``verify_cycles`` says."""
        return VerifyConfig(cycles=None if self.ci else self.verify_cycles)

    @property
    def tag_memory(self) -> tuple[TagMemory, ...]:
        """The three trainer tags, in the order the seed pauses them.

        Neither buffer tag keeps a region backup: grads are zeroed before the
        next step, and the params come back from the driver (rematerialized,
        or restored from its own host copy). ``default`` (optimizer state,
        master weights) must come back as it was: through the region backup,
        or, with ``optimizer_offload="driver"``, through the driver's copy.
        """
        return (
            TagMemory(tag="grad_buffer", cpu_backup=False),
            TagMemory(tag="default", cpu_backup=self.optimizer_offload == "saver"),
            TagMemory(tag="param_buffer", cpu_backup=False),
        )

    @classmethod
    def from_megatron(
        cls, chunks: Sequence[DistributedDataParallel], optimizer: MegatronOptimizer, **settings: Any
    ) -> MegatronDriverConfig:
        """A config whose megatron-side settings are read from the live chunks and optimizer.

        ``settings`` gives the RL-run fields (``colocate``, ``keep_old_actor``,
        ...); the fields megatron knows are filled in unless given.
        """
        facts = megatron_facts(chunks, optimizer)
        return cls(**{**facts, **settings})


def megatron_facts(chunks: Sequence[Any], optimizer: Any) -> dict[str, bool]:
    """The settings megatron itself holds, read from the DDP chunks and the optimizer."""
    ddp_configs = [chunk.ddp_config for chunk in chunks]
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    opt_configs = [getattr(o, "config", None) for o in inner]
    return {
        "use_distributed_optimizer": all(c.use_distributed_optimizer for c in ddp_configs),
        "overlap_param_gather": any(c.overlap_param_gather for c in ddp_configs),
        "precision_aware_optimizer": any(bool(getattr(c, "use_precision_aware_optimizer", False)) for c in opt_configs),
        "optimizer_cpu_offload": all(bool(getattr(c, "optimizer_cpu_offload", False)) for c in opt_configs),
    }
