"""Rank function and shared fixtures for the Megatron <-> HF converter's tests: real megatron-core, CPU, gloo.

``rank_convert`` runs on 2 ranks: first at TP = 2, then (megatron's parallel
state rebuilt) at TP = 1 with DP = 2, so one launch gives both sides. Each
rank runs shipped code only: the CPU opt-in, ``build_llama_gpt`` and the
converter; the test process holds the HF side (``transformers``).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_fsm.drivers.megatron.llama import LlamaShape

__all__ = ["SHAPE", "TOKENS", "random_hf_state", "rank_convert"]

#: GQA (2 heads per group), head_dim != hidden / heads, an ffn size of its own, 28 padding rows, a RoPE
#: base that is not the default (a converter that lost it would show in the logits).
SHAPE = LlamaShape(layers=2, hidden=64, heads=4, query_groups=2, head_dim=24, ffn_hidden=96, vocab=100,
                   padded_vocab=128, max_positions=32, rope_theta=500.0)  # fmt: skip
#: The ids every forward of the tests reads.
TOKENS = torch.randint(0, SHAPE.vocab, (2, 12), generator=torch.Generator().manual_seed(7))


def random_hf_state(shape: LlamaShape = SHAPE, seed: int = 3) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict of random fp32 weights, norms included (not ones), so that a
    mapping that loses a weight shows in the logits."""
    from miles_fsm.drivers.megatron.convert import hf_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in hf_shapes(shape).items():
        t = torch.randn(dims, generator=g)
        out[name] = 1 + 0.3 * t if name.endswith("norm.weight") else 0.2 * t
    return out


def _forward(model: Any) -> torch.Tensor:
    """Full-vocab logits ``[batch, seq, padded_vocab]``, all-gathered over TP (megatron keeps them split)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0).expand(TOKENS.shape[0], -1)
    model.eval()
    with torch.no_grad():
        local = model(TOKENS, positions, None)
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _one_tp(tp: int) -> dict[str, Any]:
    from miles_fsm.drivers.megatron.convert import iter_hf_weights, load_hf_weights
    from miles_fsm.drivers.megatron.llama import build_llama_gpt

    out: dict[str, Any] = {}
    seeded = build_llama_gpt(SHAPE, seed=11, init_std=0.2, tp=tp)
    with torch.no_grad():  # megatron inits norms to ones; random ones make a lost norm show in the logits
        g = torch.Generator().manual_seed(5)
        for name, p in seeded.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    out["seeded_hf"] = {n: t.clone() for n, t in iter_hf_weights(seeded, vocab=SHAPE.vocab)}
    out["seeded_logits"] = _forward(seeded)
    loaded = build_llama_gpt(SHAPE, seed=99, tp=tp)
    load_hf_weights(loaded, random_hf_state(), vocab=SHAPE.vocab)
    out["loaded_logits"] = _forward(loaded)
    out["loaded_back"] = {n: t.clone() for n, t in iter_hf_weights(loaded, vocab=SHAPE.vocab)}
    out["local_qkv_rows"] = loaded.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
    return out


def _refused_tp(tp: int) -> str:
    """The error of building a ``tp``-way GPT over megatron's state of another size ("" when none)."""
    from miles_fsm.drivers.megatron.llama import build_llama_gpt
    from miles_fsm.errors import ConfigError

    try:
        build_llama_gpt(SHAPE, tp=tp)
    except ConfigError as exc:
        return str(exc)
    return ""


def rank_convert(ctx: Any) -> dict[str, Any]:
    """At TP = 2, then TP = 1: a seeded GPT's HF weights and logits, and an HF state loaded and read back."""
    from megatron.core import parallel_state as ps

    from miles_fsm.drivers.megatron.cpu import enable

    enable()
    out = {"tp2": _one_tp(2)}
    out["tp1_over_tp2_refused"] = _refused_tp(1)
    ps.destroy_model_parallel()
    out["tp1"] = _one_tp(1)
    out["trainer"] = _trained_bf16()
    return _numpy(out)


def _trained_bf16() -> dict[str, Any]:
    """The driver's GPT in Llama shape (bf16, ``Float16Module``, DDP, distributed optimizer) after a train
    step on each DP rank's own data: its HF weights, read through the wrappers."""
    from miles_fsm.drivers.megatron.convert import iter_hf_weights
    from miles_fsm.drivers.megatron.gpt import GptConfig, build_tiny_gpt, train_step

    model = build_tiny_gpt(GptConfig(llama=SHAPE, vocab=SHAPE.vocab, seq=12, with_extras=False))
    train_step(model, step=0)
    hf = dict(iter_hf_weights(model.chunks[0], vocab=SHAPE.vocab))
    return {"dtypes": sorted({str(t.dtype) for t in hf.values()}), "hf": {n: t.float() for n, t in hf.items()}}


def _numpy(obj: Any) -> Any:
    # Tensors would cross the result queue as shared-memory handles, gone once the rank exits.
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    return obj
