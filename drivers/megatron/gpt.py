"""A tiny megatron-core GPT and the trainer driver that trains it: what the CPU demo and tests run.

``build_tiny_gpt`` builds a bf16 GPT (local layer spec, CPU init,
``Float16Module``) under DDP with the distributed optimizer, with the two
kinds of extras megatron models carry: an fp32 param and an fp32
``expert_bias`` buffer. ``GptTrainer`` is a ``MegatronTrainer`` over it that
also trains: ``train_step`` (forward, backward, grad reduce-scatter,
optimizer step and its param all-gather) and ``train_collectives``, the
collectives that step issues, for ``Lifecycle.agree_on("train", ...)``.

On CPU, call ``miles_fsm.drivers.megatron.cpu.enable()`` first (``build_cpu_gpt_trainer``
does both).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles_fsm.drivers.megatron.buffers import ddp_buffers_in_tags
from miles_fsm.drivers.megatron.config import MegatronDriverConfig
from miles_fsm.drivers.megatron.driver import MegatronTrainer
from miles_fsm.drivers.megatron.llama import LlamaShape
from miles_fsm.drivers.megatron.optimizer import OPTIMIZER_TAG, coalesce_optimizer_state
from miles_fsm.errors import ConfigError
from miles_fsm.plan import Collective
from miles_fsm.states import TRAINER_TAGS, Step, StepKind, Strategy

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from miles_fsm.drivers.cpu_memory import MemorySaver

__all__ = ["GptConfig", "GptTrainer", "TinyGpt", "build_tiny_gpt", "train_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GptConfig:
    """The tiny GPT's shape, its optimizer and its data."""

    seed: int = 1234
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 16
    batch: int = 2
    lr: float = 1e-3
    #: Substrings of param names to freeze (``requires_grad=False``): DDP skips
    #: those, which makes the model ineligible for rematerialize.
    frozen: tuple[str, ...] = ()
    #: An fp32 param and an fp32 ``expert_bias`` buffer on the final norm.
    with_extras: bool = True
    #: None: one bucket per buffer, no overlapped grad reduce.
    bucket_size: int | None = None
    #: A Llama shape (``drivers/megatron/llama.py``) instead of ``layers``/``hidden``/``heads``/``vocab``:
    #: the GPT the HF converter maps (set ``with_extras=False``; ``vocab`` still bounds the token ids).
    llama: LlamaShape | None = None


@dataclass(kw_only=True, slots=True)
class TinyGpt:
    """The DDP chunks and the chained distributed optimizer of one tiny GPT, and its config."""

    chunks: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    config: GptConfig


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # megatron warns at import that Apex/TransformerEngine are absent, and about its own
    # deprecations on every CPU call; neither is actionable here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build_tiny_gpt(config: GptConfig | None = None, *, saver: MemorySaver | None = None) -> TinyGpt:
    """A bf16 GPT under DDP + the distributed optimizer, built identically on every rank.

    Needs the default process group. With ``saver``, the DDP param and grad
    buffers are allocated through it (``param_buffer``, ``grad_buffer``).
    """
    cfg = config or GptConfig()
    with _quiet():
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

    if not dist.is_initialized():
        raise ConfigError(["megatron needs the default process group: call torch.distributed.init_process_group"
                           " first (gloo on CPU; miles_fsm.launch.local.run_ranks does it)"], "build_tiny_gpt")  # fmt: skip
    with _quiet():
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        shape = {"num_layers": cfg.layers, "hidden_size": cfg.hidden, "num_attention_heads": cfg.heads,
                 "hidden_dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip
        tconfig = TransformerConfig(
            **(cfg.llama.megatron_kwargs() if cfg.llama else shape),
            use_cpu_initialization=True,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
        )
        if cfg.llama:
            spec, model_kwargs = get_gpt_layer_local_spec(normalization="RMSNorm"), cfg.llama.gpt_kwargs()
        else:
            spec, model_kwargs = get_gpt_layer_local_spec(), {"vocab_size": cfg.vocab, "max_sequence_length": cfg.seq}
        gpt = GPTModel(config=tconfig, transformer_layer_spec=spec, **model_kwargs)
        model = Float16Module(tconfig, gpt)
        if cfg.with_extras:
            # Added after the bf16 cast, so they stay fp32 like a router's bias.
            norm = gpt.decoder.final_layernorm
            hidden = tconfig.hidden_size
            norm.register_parameter("extra_scale", torch.nn.Parameter(torch.zeros(hidden, dtype=torch.float32)))
            norm.register_buffer("expert_bias", torch.zeros(hidden, dtype=torch.float32))
            norm.register_forward_hook(_extras_hook)
        for name, p in model.named_parameters():
            if any(f in name for f in cfg.frozen):
                p.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=cfg.bucket_size is not None,
            overlap_param_gather=False,
            use_distributed_optimizer=True,
            bucket_size=cfg.bucket_size,
        )
        with ddp_buffers_in_tags(saver) if saver is not None else contextlib.nullcontext():
            ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=0.01, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
        )
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    return TinyGpt(chunks=[ddp], optimizer=optimizer, config=cfg)


def _extras_hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    extra, bias = module.get_parameter("extra_scale"), module.get_buffer("expert_bias")
    scale = (extra + bias).to(output.dtype)
    return output * (1 + scale)


class GptTrainer(MegatronTrainer):
    """A ``MegatronTrainer`` that owns a ``TinyGpt`` and trains it.

    With a saver, the optimizer state is kept under ``default`` like the DDP
    buffers under theirs: the master shards when built, Adam's moments
    right after the first step (torch allocates them lazily, in that step).
    """

    def __init__(self, *, model: TinyGpt, saver: MemorySaver | None = None, **kwargs: Any) -> None:
        super().__init__(chunks=model.chunks, optimizer=model.optimizer, memory=saver, **kwargs)
        self.model = model
        self.saver = saver
        self._moments_in_tag = saver is None
        self._to_tag()

    @classmethod
    def build(cls, *, gpt: GptConfig | None = None, saver: MemorySaver | None = None,
              strategy: Strategy | str = Strategy.REMATERIALIZE, **settings: Any) -> GptTrainer:  # fmt: skip
        """Build the GPT (``build_tiny_gpt``) and its driver, the config read from the megatron objects."""
        model = build_tiny_gpt(gpt, saver=saver)
        config = MegatronDriverConfig.from_megatron(model.chunks, model.optimizer, strategy=strategy, **settings)
        return cls(model=model, saver=saver, config=config)

    def _to_tag(self) -> None:
        saver = self.saver
        if saver is None:
            return
        backup = next(t.cpu_backup for t in self.config.tag_memory if t.tag == OPTIMIZER_TAG)
        with _quiet():
            coalesce_optimizer_state(self.optimizer, lambda n: saver.empty(OPTIMIZER_TAG, n, torch.uint8, backup=backup))

    def train_collectives(self) -> tuple[Collective, ...]:
        """What ``train_step`` issues, from the bucket layout alone (rank-uniform): a grad reduce-scatter
        per bucket, the grad-norm all-reduce of clipping, then the optimizer's param all-gather per bucket."""
        out = []
        for i, chunk in enumerate(self.chunks):
            for j, group in enumerate(chunk.bucket_groups):
                for bucket in group.buckets:
                    dtype = str(bucket.grad_data.dtype).removeprefix("torch.")
                    out.append(Collective("reduce_scatter", f"chunk{i}.dp.bg{j}", dtype, bucket.grad_data.numel()))
        out.append(Collective("all_reduce", "dp.grad_norm", "float32", 1))
        return (*out, *self.collectives(Step(StepKind.PARAM_SYNC)))

    def train_step(self, *, step: int, tokens: torch.Tensor | None = None) -> float:
        """``train_step`` on the GPT; refused unless every trainer tag is resident. Returns the loss."""
        self._require_resident("train", TRAINER_TAGS)
        loss = train_step(self.model, step=step, tokens=tokens)
        if not self._moments_in_tag:
            self._to_tag()
            self._moments_in_tag = True
        return loss


def train_step(model: TinyGpt, *, step: int, tokens: torch.Tensor | None = None) -> float:
    """One real train step: forward, backward, grad reduce-scatter, optimizer step (and its all-gather).

    ``tokens`` is ``[batch, seq]`` of ids below the vocab; by default each
    rank draws its own (seeded by rank and step), so the ranks' gradients
    differ and the reduce-scatter and all-gather matter. Returns the loss.
    """
    cfg = model.config
    if tokens is None:
        g = torch.Generator().manual_seed(1000 * step + (dist.get_rank() if dist.is_initialized() else 0))
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with _quiet():
        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        model.optimizer.zero_grad()
        losses = [chunk(tokens, position_ids, None, labels=labels) for chunk in model.chunks]
        loss = sum(x.float().mean() for x in losses)
        loss.backward()
        for chunk in model.chunks:
            chunk.finish_grad_sync()
        ok, _, _ = model.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped (non-finite grads)")
    # Expert-bias-like buffers are updated outside the optimizer, as routers do.
    for name, buf in model.chunks[0].module.named_buffers():
        if name.endswith("expert_bias"):
            buf.add_(0.001 * (step + 1))
    return float(loss.detach())
