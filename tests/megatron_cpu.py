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
) -> TinyGPT:
    """Build a GPT (local layer spec, CPU init) in bf16 under DDP + distributed optimizer.

    ``frozen`` names params (substrings of their names) to set
    ``requires_grad=False``: DDP skips those, which makes the model
    ineligible for rematerialize. ``with_extras`` adds an fp32 param and an
    fp32 ``expert_bias`` buffer, the two kinds of extras megatron models carry.
    """
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
