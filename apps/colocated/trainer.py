"""The trainer side of the loop: a Llama-shaped megatron GPT on CUDA under torch_memory_saver tags.

``build_gpt`` builds it like ``benchmarks/lifecycle/gpu.py`` builds its GPT:
bf16 (``Float16Module``), DDP with the distributed optimizer, the DDP param
and grad buffers under ``param_buffer`` / ``grad_buffer``, the optimizer
state (created by a first step) coalesced into one allocation under
``default`` without a region backup: the driver keeps it
(``optimizer_offload="driver"``). ``PushTrainer`` is the ``MegatronTrainer``
whose push is the HF conversion (``drivers/megatron/convert.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from miles_fsm.apps.colocated.checks import FUSED
from miles_fsm.apps.colocated.config import LoopConfig
from miles_fsm.drivers.megatron.convert import Mistake, iter_hf_weights
from miles_fsm.drivers.megatron.driver import MegatronTrainer, coalesce_optimizer_state, ddp_buffers_in_tags

__all__ = ["Gpt", "PhaseTimer", "PushTrainer", "build_gpt", "megatron_logprobs", "train_step", "wrong_weights"]


@dataclass(kw_only=True, slots=True)
class Gpt:
    """The DDP chunk, the optimizer, and what they were built from."""

    chunk: Any
    optimizer: Any
    params: int
    optimizer_bytes: int


def build_gpt(cfg: LoopConfig, saver: Any, ids: torch.Tensor) -> Gpt:
    """The GPT under the saver's tags; one train step on ``ids`` creates Adam's state before it is coalesced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron: Apex/TransformerEngine absent, its own deprecations
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
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        tconfig = TransformerConfig(**cfg.shape.megatron_kwargs(), bf16=True, params_dtype=torch.bfloat16,
                                    pipeline_dtype=torch.bfloat16, init_method_std=cfg.init_std)  # fmt: skip
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        gpt = GPTModel(config=tconfig, transformer_layer_spec=spec, **cfg.shape.gpt_kwargs())
        model = Float16Module(tconfig, gpt.cuda())
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, use_distributed_optimizer=True)  # fmt: skip
        with ddp_buffers_in_tags(saver):
            chunk = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
        torch.cuda.empty_cache()
        opt_config = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=0.0, bf16=True,
                                     use_distributed_optimizer=True, clip_grad=1.0)  # fmt: skip
        optimizer = get_megatron_optimizer(opt_config, [chunk])
    gpt_ = Gpt(chunk=chunk, optimizer=optimizer, params=sum(p.numel() for p in model.parameters()), optimizer_bytes=0)
    train_step(gpt_, ids, step=0)
    gpt_.optimizer_bytes = coalesce_optimizer_state(optimizer, lambda n: saver.empty("default", n, torch.uint8))
    torch.cuda.empty_cache()
    return gpt_


def train_step(gpt: Gpt, ids: torch.Tensor, *, step: int) -> float:
    """One step of next-token loss on ``ids`` ``[batch, seq]`` (the probe batch, so its logprobs move)."""
    labels = torch.roll(ids, -1, dims=1)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt.chunk.zero_grad_buffer()
        gpt.optimizer.zero_grad()
        loss = gpt.chunk(ids, positions, None, labels=labels).float().mean()
        loss.backward()
        gpt.chunk.finish_grad_sync()
        ok, _, _ = gpt.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped (non-finite grads)")
    return float(loss.detach())


@torch.no_grad()
def megatron_logprobs(gpt: Gpt, ids: torch.Tensor, vocab: int) -> list[list[float]]:
    """Per prompt, the logprob megatron's own forward gives tokens 1..n-1 of ``ids`` (fp32 log-softmax)."""
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    gpt.chunk.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = gpt.chunk(ids, positions, None)[..., :vocab].float()
    finally:
        gpt.chunk.train()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp.cpu().tolist()


class PhaseTimer:
    """Seconds per named phase of a push, and a profiler range of the same name around each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._patched: list[tuple[Any, str, Any]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        import time

        t0 = time.perf_counter()
        with torch.profiler.record_function(name):
            try:
                yield
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of ``owner.attr`` as ``name`` until ``unwrap``."""
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        self._patched.append((owner, attr, original))

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


class PushTrainer(MegatronTrainer):
    """A ``MegatronTrainer`` whose push is the chunk's HF ``LlamaForCausalLM`` weights.

    ``copy=True`` pushes fresh CUDA copies: a tensor goes to SGLang as a CUDA
    IPC handle of its allocation, and the params live in torch_memory_saver's
    mapped (``cuMemCreate``) memory, which the legacy IPC export is not
    documented to support. A flattened bucket is itself a fresh copy.
    """

    def __init__(self, *, gpt: Gpt, vocab: int, copy: bool, timer: PhaseTimer, **kwargs: Any) -> None:
        super().__init__(chunks=[gpt.chunk], optimizer=gpt.optimizer, **kwargs)
        self._vocab = vocab
        self._copy = copy
        self._timer = timer
        self.pushed_bytes = 0

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_resident("push weights", ("param_buffer",))
        with self._timer.phase("convert" + (" + copy" if self._copy else "")):
            out = [(n, t.detach().clone() if self._copy else t.detach())
                   for n, t in iter_hf_weights(self.chunks[0], vocab=self._vocab)]  # fmt: skip
            torch.cuda.synchronize()
        self.pushed_bytes = sum(t.numel() * t.element_size() for _, t in out)
        # Converted (and timed) in full before the first is handed out, so the push's phases stay apart.
        return iter(out)


#: The weights each deliberate mistake changes, and the ones its fused engine weight also needs.
_TOUCHED = {Mistake.QK_SWAPPED: FUSED["self_attn.qkv_proj.weight"], Mistake.GATE_UP_SWAPPED: FUSED["mlp.gate_up_proj.weight"]}


def wrong_weights(gpt: Gpt, vocab: int, mistake: Mistake) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Host copies of the weights ``mistake`` touches, converted wrongly and rightly (``"wrong"``, ``"right"``).

    Taken while the params are resident; pushed later, while the engine
    generates and the param buffer is paused, then the right ones put back.
    """
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for label, m in (("wrong", mistake), ("right", None)):
        out[label] = [(n, t.detach().to("cpu", copy=True)) for n, t in iter_hf_weights(gpt.chunk, vocab=vocab, mistake=m)
                      if n.endswith(_TOUCHED[mistake])]  # fmt: skip
    return out
