"""Real megatron-core on CPU with gloo: the four test-only patches and a tiny GPT.

megatron-core assumes CUDA in a few places. These patches make its DDP,
distributed optimizer and GPT run on CPU so the Megatron driver can be tested
in CI against the real library. They live here, in test code only: the driver
itself never patches megatron or torch.

``apply_cpu_patches()`` must run inside each rank's process before megatron
builds anything; it is idempotent.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TinyGPT", "apply_cpu_patches", "build_tiny_gpt", "megatron_available", "train_step"]

_CPU = torch.device("cpu")
_APPLIED = False


def megatron_available() -> str | None:
    """None if megatron-core imports, else why not (for ``pytest.skip``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as exc:
        return f"megatron-core is not importable ({exc}); install the 'test' extra on Python 3.11"
    return None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Patch 2 (and 3): ``device='cuda'`` becomes cpu, ``.cuda()`` is a no-op,
    and ``Tensor.type()`` answers with the CUDA type name megatron checks for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and args and _is_cuda(args[1] if len(args) > 1 else None):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def apply_cpu_patches() -> None:
    """Apply the four patches in this process (test processes only)."""
    global _APPLIED
    if _APPLIED:
        return
    # Patch 1: buffers are allocated on torch.cuda.current_device().
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    # Patches 2 and 3: a function mode that stays pushed for the process's life.
    _CudaToCpu().__enter__()
    # Patch 4: the CUDA RNG calls go to the CPU generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Noise from megatron's own calls on CPU; the children are not under pytest's filters.
    for message in (".*is deprecated.*", ".*non-leaf Tensor.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)
    _APPLIED = True


@dataclass(kw_only=True, slots=True)
class TinyGPT:
    """A bf16 GPT under DDP with the distributed optimizer, plus what built it."""

    chunks: list[Any]
    optimizer: Any
    config: Any
    vocab: int
    seq: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def build_tiny_gpt(
    *,
    seed: int = 1234,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 128,
    seq: int = 16,
    frozen: tuple[str, ...] = (),
    with_extras: bool = True,
    bucket_size: int | None = None,
    saver: Any = None,
) -> TinyGPT:
    """Build a GPT (local layer spec, CPU init) in bf16 under DDP + distributed optimizer.

    ``frozen`` names params (substrings of their names) to set
    ``requires_grad=False``: DDP skips those, which makes the model
    ineligible for rematerialize. ``with_extras`` adds an fp32 param and an
    fp32 ``expert_bias`` buffer, the two kinds of extras megatron models carry.
    With ``saver``, the DDP param and grad buffers are allocated through it
    under the ``param_buffer`` and ``grad_buffer`` tags.
    """
    import contextlib

    from miles_fsm.drivers.megatron import ddp_buffers_in_tags

    apply_cpu_patches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
    )
    model = Float16Module(config, gpt)
    extras: dict[str, torch.Tensor] = {}
    if with_extras:
        # Added after the bf16 cast, so they stay fp32 like a router's bias.
        norm = gpt.decoder.final_layernorm
        norm.register_parameter("extra_scale", torch.nn.Parameter(torch.zeros(hidden, dtype=torch.float32)))
        norm.register_buffer("expert_bias", torch.zeros(hidden, dtype=torch.float32))
        norm.register_forward_hook(_extras_hook)
    for name, p in model.named_parameters():
        if any(f in name for f in frozen):
            p.requires_grad_(False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    with ddp_buffers_in_tags(saver) if saver is not None else contextlib.nullcontext():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        bf16=True,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return TinyGPT(chunks=[ddp], optimizer=optimizer, config=config, vocab=vocab, seq=seq)


def _extras_hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    scale = (module.extra_scale + module.expert_bias).to(output.dtype)
    return output * (1 + scale)


def train_step(gpt: TinyGPT, *, step: int) -> float:
    """One real train step: forward, backward, grad reduce-scatter, optimizer step.

    Every rank draws different tokens (seeded by rank and step), so the ranks'
    gradients differ and the reduce-scatter and param all-gather matter.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, gpt.vocab, (2, gpt.seq), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(gpt.seq).unsqueeze(0).expand(2, -1)
    for chunk in gpt.chunks:
        chunk.zero_grad_buffer()
    gpt.optimizer.zero_grad()
    losses = [chunk(tokens, position_ids, None, labels=labels) for chunk in gpt.chunks]
    loss = sum(l.float().mean() for l in losses)
    loss.backward()
    for chunk in gpt.chunks:
        chunk.finish_grad_sync()
    ok, _, _ = gpt.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped (non-finite grads)")
    # Expert-bias-like buffers are updated outside the optimizer, as routers do.
    for name, buf in gpt.chunks[0].module.named_buffers():
        if name.endswith("expert_bias"):
            buf.add_(0.001 * (step + 1))
    return float(loss.detach())


# --------------------------------------------------------------------------- rank functions
# Module-level so ``miles_fsm.launch.run_ranks`` can import them in each child.


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
    apply_cpu_patches()
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron import MegatronTrainer
    from miles_fsm.drivers.megatron_config import MegatronDriverConfig
    from miles_fsm.errors import MemoryReleasedError
    from miles_fsm.states.errors import VerificationError
    from miles_fsm.states import Step, StepKind, Strategy

    strategy = Strategy(ctx.kwargs["strategy"])
    saver = CpuMemorySaver()
    gpt = build_tiny_gpt(saver=saver)
    config = MegatronDriverConfig.from_megatron(gpt.chunks, gpt.optimizer, strategy=strategy, ci=True)
    driver = MegatronTrainer(chunks=gpt.chunks, optimizer=gpt.optimizer, config=config, memory=saver)
    lc = _lifecycle(driver)
    lc.start()
    out: dict[str, Any] = {"cycles": [], "paused_resident": [], "resident_training": saver.resident_bytes()}
    sync = Step(StepKind.PARAM_SYNC)
    for cycle in range(ctx.kwargs.get("cycles", 3)):
        train_step(gpt, step=cycle)
        before = digest_tensors(driver.tensors())
        plan_training = (driver.tensor_set(), driver.collectives(sync))

        def in_paused() -> None:
            out["paused_resident"].append(saver.resident_bytes(["param_buffer", "grad_buffer"]))
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
        train_step(gpt, step=99)
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
    apply_cpu_patches()
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron import MegatronTrainer
    from miles_fsm.drivers.megatron_config import MegatronDriverConfig
    from miles_fsm.drivers.errors import IneligibleModelError
    from miles_fsm.errors import ConfigError, RankDivergenceError
    from miles_fsm.states import Strategy

    out: dict[str, Any] = {}
    frozen = build_tiny_gpt(frozen=("final_layernorm.weight",), with_extras=False)
    try:
        MegatronTrainer(chunks=frozen.chunks, optimizer=frozen.optimizer)
    except IneligibleModelError as exc:
        out["ineligible"] = list(exc.params)
        out["ineligible_message"] = str(exc)
    name = "module.decoder.final_layernorm.weight"
    ok = MegatronTrainer(
        chunks=frozen.chunks,
        optimizer=frozen.optimizer,
        config=MegatronDriverConfig.from_megatron(frozen.chunks, frozen.optimizer, extra_params=(name,)),
    )
    out["extra_param_backed_up"] = name in ok._extras()
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

    saver = CpuMemorySaver()
    gpt = build_tiny_gpt(saver=saver)
    driver = MegatronTrainer(
        chunks=gpt.chunks,
        optimizer=gpt.optimizer,
        config=MegatronDriverConfig.from_megatron(gpt.chunks, gpt.optimizer, ci=True),
        memory=saver,
    )
    counters = [_CountingSync(chunk) for chunk in gpt.chunks]
    lc = _lifecycle(driver, guard_timeout_s=20.0)
    lc.start()
    train_step(gpt, step=0)
    _cycle(lc)
    out["syncs_after_healthy_cycle"] = [c.calls for c in counters]
    train_step(gpt, step=1)  # the optimizer's own param sync runs here, outside the lifecycle
    out["syncs_before_divergent_cycle"] = [c.calls for c in counters]

    def diverge() -> None:
        # The seed's bug in miniature: one rank's tensor set differs from the others'.
        if ctx.rank == 1:
            norm = gpt.chunks[0].module.module.decoder.final_layernorm
            norm.register_buffer("stray_bias", torch.zeros(8))

    try:
        _cycle(lc, between=diverge)
    except RankDivergenceError as exc:
        out["divergence"] = {"field": exc.field, "groups": {k: list(v) for k, v in exc.groups.items()}}
    out["syncs_after_divergence"] = [c.calls for c in counters]
    out["state"] = lc.state.value
    return out
