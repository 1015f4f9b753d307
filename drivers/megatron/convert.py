"""Megatron (local-spec, Llama-shaped GPT) <-> HF ``LlamaForCausalLM`` weights, with TP gather and shard.

What maps to what (bare ``GPTModel`` names; layer ``i``):

==========================================  ==============================================
megatron                                     HF
==========================================  ==============================================
``embedding.word_embeddings.weight``         ``model.embed_tokens.weight`` (padding rows dropped)
``decoder.layers.i.input_layernorm.weight``  ``model.layers.i.input_layernorm.weight``
``...self_attention.linear_qkv.weight``      ``...self_attn.{q,k,v}_proj.weight``
``...self_attention.linear_proj.weight``     ``...self_attn.o_proj.weight``
``...pre_mlp_layernorm.weight``              ``...post_attention_layernorm.weight``
``...mlp.linear_fc1.weight``                 ``...mlp.gate_proj.weight``, ``...mlp.up_proj.weight``
``...mlp.linear_fc2.weight``                 ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``           ``model.norm.weight``
``output_layer.weight``                      ``lm_head.weight`` (padding rows dropped)
==========================================  ==============================================

``linear_qkv`` holds, per query group, that group's query heads, then its key
head, then its value head: viewed as ``[groups, heads_per_group + 2, head_dim,
hidden]`` and split on dim 1 as ``[heads_per_group, 1, 1]``. ``linear_fc1`` is
the gate, then the up projection. Megatron's default RoPE rotates halves, as
HF Llama does, so q and k need no permutation.

Under tensor parallelism (``TpSplit``): the embedding, the output layer and
``linear_qkv`` (whole query groups per rank) are split on dim 0,
``linear_proj`` and ``linear_fc2`` on dim 1, and ``linear_fc1`` on dim 0 with
stride 2 (each rank holds its slice of the gate, then its slice of up).

The pure functions (``megatron_to_hf``, ``hf_to_megatron``, ``gather_shards``,
``shard_of``) take full tensors; ``iter_hf_weights`` and ``load_hf_weights``
work on a live model, gathering or sharding over megatron's TP group.
``mistake=`` makes a deliberately wrong conversion, for checks that must be
able to fail.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_fsm.drivers.errors import NotLlamaShapedError, WeightLayoutError
from miles_fsm.drivers.megatron.llama import LlamaShape, unwrap_gpt

__all__ = [
    "Mistake",
    "TpSplit",
    "gather_shards",
    "hf_shapes",
    "hf_to_megatron",
    "iter_hf_weights",
    "load_hf_weights",
    "megatron_shapes",
    "megatron_to_hf",
    "shard_of",
    "tp_split",
]


class Mistake(enum.Enum):
    """A deliberately wrong conversion: the weights still load, but the model computes something else."""

    #: In each query group, every query head is read from the key head's rows, and the key from the
    #: first query head's: q and k trade places in every head, as a converter that misreads the
    #: interleaved ``linear_qkv`` would. (Swapping one query head per group moved SGLang's logprobs
    #: on the H200 by 0.050 mean, too close to bf16's own tolerance to call the check one that fails.)
    QK_SWAPPED = "qk_swapped"
    #: The gate and up projections trade places.
    GATE_UP_SWAPPED = "gate_up_swapped"


@dataclass(frozen=True, slots=True)
class TpSplit:
    """How megatron splits a weight over the TP ranks: on ``dim``, in ``stride`` interleaved parts."""

    dim: int
    stride: int = 1


@dataclass(frozen=True, slots=True)
class _Rule:
    megatron: str
    hf: tuple[str, ...]
    split: TpSplit | None
    kind: str  # "copy", "vocab", "qkv" or "fc1"


_LAYER_RULES = (
    _Rule("input_layernorm.weight", ("input_layernorm.weight",), None, "copy"),
    _Rule("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight"), TpSplit(0), "qkv"),
    _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), TpSplit(1), "copy"),
    _Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None, "copy"),
    _Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), TpSplit(0, 2), "fc1"),
    _Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), TpSplit(1), "copy"),
)  # fmt: skip
_EMBEDDING = _Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), TpSplit(0), "vocab")
_FINAL_NORM = _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), None, "copy")
_OUTPUT = _Rule("output_layer.weight", ("lm_head.weight",), TpSplit(0), "vocab")
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# The TransformerEngine spec fuses the pre-attention and pre-MLP norms into the next linear layer.
_TE_NAME = re.compile(r"\.(linear_qkv|linear_fc1)\.layer_norm_(weight|bias)$")


def _rules(shape: LlamaShape) -> Iterator[_Rule]:
    yield _EMBEDDING
    for i in range(shape.layers):
        for r in _LAYER_RULES:
            hf = tuple(f"model.layers.{i}.{n}" for n in r.hf)
            yield _Rule(f"decoder.layers.{i}.{r.megatron}", hf, r.split, r.kind)
    yield _FINAL_NORM
    yield _OUTPUT


def tp_split(name: str) -> TpSplit | None:
    """How megatron splits the (bare) param ``name`` over TP ranks; None when every rank holds it whole."""
    m = _LAYER_NAME.match(name)
    suffix = m.group(2) if m else name
    for r in (*_LAYER_RULES, _EMBEDDING, _FINAL_NORM, _OUTPUT):
        if r.megatron == suffix:
            return r.split
    raise WeightLayoutError(side="megatron", unknown=[name], missing=(), mismatched=())


def _hf_dims(rule: _Rule, s: LlamaShape) -> tuple[tuple[int, ...], ...]:
    h, d = s.hidden, s.head_dim
    if rule.kind == "vocab":
        return ((s.vocab, h),)
    if rule.kind == "qkv":
        return (s.heads * d, h), (s.query_groups * d, h), (s.query_groups * d, h)
    if rule.kind == "fc1":
        return (s.ffn_hidden, h), (s.ffn_hidden, h)
    if rule.megatron.endswith("linear_proj.weight"):
        return ((h, s.heads * d),)
    if rule.megatron.endswith("linear_fc2.weight"):
        return ((h, s.ffn_hidden),)
    return ((h,),)


def _megatron_dims(rule: _Rule, s: LlamaShape) -> tuple[int, ...]:
    if rule.kind == "vocab":
        return (s.padded_vocab, s.hidden)
    if rule.kind in ("qkv", "fc1"):
        parts = _hf_dims(rule, s)
        return (sum(p[0] for p in parts), s.hidden)
    return _hf_dims(rule, s)[0]


def megatron_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every (bare) megatron param name of a GPT of this shape, with its full (TP-gathered) shape."""
    return {r.megatron: _megatron_dims(r, shape) for r in _rules(shape)}


def hf_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every ``LlamaForCausalLM`` weight name of this shape, with its shape."""
    return {n: dims for r in _rules(shape) for n, dims in zip(r.hf, _hf_dims(r, shape), strict=True)}


def _check_layout(side: str, given: Mapping[str, Sequence[int]], expected: Mapping[str, tuple[int, ...]]) -> None:
    te = sorted(n for n in given if _TE_NAME.search(n))
    if te:
        raise NotLlamaShapedError(
            problems=[f"it has TransformerEngine's fused norm weights ({te[0]}, ...): build it with "
                      "get_gpt_layer_local_spec(), whose norms are input_layernorm / pre_mlp_layernorm"],
            source=f"the {side} state dict",
        )  # fmt: skip
    unknown = sorted(set(given) - set(expected))
    missing = sorted(set(expected) - set(given))
    mismatched = sorted(f"{n} {tuple(given[n])} != {expected[n]}" for n in set(given) & set(expected)
                        if tuple(given[n]) != expected[n])  # fmt: skip
    if unknown or missing or mismatched:
        raise WeightLayoutError(side=side, unknown=unknown, missing=missing, mismatched=mismatched)


def _to_hf(rule: _Rule, w: torch.Tensor, s: LlamaShape, mistake: Mistake | None) -> tuple[torch.Tensor, ...]:
    if rule.kind == "vocab":
        return (w[: s.vocab],)
    if rule.kind == "fc1":
        gate, up = w.chunk(2, dim=0)
        return (up, gate) if mistake is Mistake.GATE_UP_SWAPPED else (gate, up)
    if rule.kind == "qkv":
        grouped = w.view(s.query_groups, s.heads_per_group + 2, s.head_dim, s.hidden)
        q, k, v = grouped.split([s.heads_per_group, 1, 1], dim=1)
        if mistake is Mistake.QK_SWAPPED:
            q, k = k.expand_as(q), q[:, :1]
        return tuple(t.reshape(-1, s.hidden) for t in (q, k, v))
    return (w,)


def _from_hf(rule: _Rule, parts: Sequence[torch.Tensor], s: LlamaShape) -> torch.Tensor:
    if rule.kind == "vocab":
        (w,) = parts
        pad = w.new_zeros(s.padded_vocab - s.vocab, s.hidden)
        return torch.cat([w, pad]) if len(pad) else w
    if rule.kind == "fc1":
        return torch.cat(list(parts), dim=0)
    if rule.kind == "qkv":
        q, k, v = parts
        grouped = [q.reshape(s.query_groups, s.heads_per_group, s.head_dim, s.hidden),
                   k.reshape(s.query_groups, 1, s.head_dim, s.hidden),
                   v.reshape(s.query_groups, 1, s.head_dim, s.hidden)]  # fmt: skip
        return torch.cat(grouped, dim=1).reshape(-1, s.hidden)
    return parts[0]


def megatron_to_hf(state: Mapping[str, torch.Tensor], shape: LlamaShape, *,
                   mistake: Mistake | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """A ``LlamaForCausalLM`` state dict from a full (TP-gathered) bare megatron one.

    ``state`` may be ``model.state_dict()`` of a bare GPT at TP 1 (its
    ``_extra_state`` entries are skipped). Refuses, before converting anything, names or shapes that are not this
    shape's (``WeightLayoutError``) and TransformerEngine's fused norm names
    (``NotLlamaShapedError``). The tensors may share memory with ``state``'s.
    """
    # megatron's state_dict() carries an ``_extra_state`` (fp8 metadata) per linear layer: not a weight.
    state = {n: t for n, t in state.items() if not n.endswith("._extra_state")}
    _check_layout("megatron", {n: t.shape for n, t in state.items()}, megatron_shapes(shape))
    out: dict[str, torch.Tensor] = {}
    for rule in _rules(shape):
        out.update(zip(rule.hf, _to_hf(rule, state[rule.megatron], shape, mistake), strict=True))
    return out


def hf_to_megatron(state: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """A full bare megatron state dict from a ``LlamaForCausalLM`` one (the embedding and output padded
    with zero rows up to ``padded_vocab``); the inverse of ``megatron_to_hf``, bit for bit."""
    _check_layout("HF", {n: t.shape for n, t in state.items()}, hf_shapes(shape))
    return {r.megatron: _from_hf(r, [state[n] for n in r.hf], shape) for r in _rules(shape)}


def gather_shards(shards: Sequence[torch.Tensor], split: TpSplit) -> torch.Tensor:
    """The full weight from every TP rank's shard, in rank order (``split`` from ``tp_split``)."""
    if split.stride == 1:
        return torch.cat(list(shards), dim=split.dim)
    parts = [s.chunk(split.stride, dim=split.dim) for s in shards]
    return torch.cat([p[j] for j in range(split.stride) for p in parts], dim=split.dim)


def shard_of(full: torch.Tensor, split: TpSplit, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of a full weight, as megatron lays it out; the inverse of ``gather_shards``."""
    if full.shape[split.dim] % (split.stride * size):
        raise WeightLayoutError(side="megatron", unknown=(), missing=(), mismatched=[
            f"dim {split.dim} of {tuple(full.shape)} does not split into {split.stride} x {size} TP parts"])  # fmt: skip
    pieces = full.chunk(split.stride, dim=split.dim)
    return torch.cat([p.chunk(size, dim=split.dim)[rank] for p in pieces], dim=split.dim)


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _local_params(model: Any, shape: LlamaShape, tp_size: int) -> dict[str, torch.Tensor]:
    """The live GPT's params by bare name, checked against the shape's layout as split over ``tp_size``."""
    params = {n: p for n, p in unwrap_gpt(model).named_parameters()}
    expected = {}
    for name, dims in megatron_shapes(shape).items():
        split = tp_split(name)
        if split is not None:
            dims = tuple(d // tp_size if i == split.dim else d for i, d in enumerate(dims))
        expected[name] = dims
    _check_layout("megatron", {n: p.shape for n, p in params.items()}, expected)
    if shape.query_groups % tp_size:
        raise NotLlamaShapedError(problems=[f"{shape.query_groups} query groups do not split over {tp_size} TP "
                                            "ranks: the converter needs whole groups per rank"], source="the model")  # fmt: skip
    return params


def iter_hf_weights(model: torch.nn.Module, *, vocab: int | None = None, mistake: Mistake | None = None,
                    ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """``(hf_name, tensor)`` for every ``LlamaForCausalLM`` weight of a live megatron GPT, in a fixed order.

    ``model`` is the GPT, bare or wrapped (``Float16Module``, DDP). Under TP,
    each split weight is all-gathered over megatron's TP group, so every TP
    rank must iterate to the end, in step. ``vocab``: the HF vocab, when the
    embedding is padded beyond it. Tensors keep the params' dtype and device,
    and may be views of the params: copy them to keep them past a train step.
    """
    import torch.distributed as dist

    shape = LlamaShape.from_megatron(model, vocab=vocab)
    _, size, group = _tp()
    params = _local_params(model, shape, size)
    for rule in _rules(shape):
        w = params[rule.megatron].detach()
        if rule.split is not None and size > 1:
            shards = [torch.empty_like(w) for _ in range(size)]
            dist.all_gather(shards, w.contiguous(), group=group)
            w = gather_shards(shards, rule.split)
        yield from zip(rule.hf, _to_hf(rule, w, shape, mistake), strict=True)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, vocab: int | None = None) -> None:
    """Copy a ``LlamaForCausalLM`` state dict into a live megatron GPT, each TP rank its own shard.

    Every name and shape is checked before any param is written. Values are
    cast to each param's dtype; padding rows of the vocab become zeros.
    """
    shape = LlamaShape.from_megatron(model, vocab=vocab)
    rank, size, _ = _tp()
    params = _local_params(model, shape, size)
    full = hf_to_megatron(state, shape)
    for name, p in params.items():
        split = tp_split(name)
        p.copy_(full[name] if split is None or size == 1 else shard_of(full[name], split, rank, size))
