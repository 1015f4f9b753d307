"""The reference model: a tiny decoder-only LM, its weights and its forward pass.

The trainer (``drivers/reference/trainer.py``) and the engine
(``drivers/reference/engine.py``) each hold their own copy of these weights
and must compute alike, so the model lives here, apart from either: what it
is (``ModelConfig``, ``weight_specs``), how it starts (``initial_value``) and
how it runs (``forward``, with an optional ``KVCache`` for the engine's
incremental decoding). Nothing here allocates through a memory saver or
knows about tags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_fsm.errors import ConfigError

__all__ = [
    "EXTRA_BUFFERS",
    "EXTRA_PARAMS",
    "KVCache",
    "ModelConfig",
    "WeightSpec",
    "forward",
    "initial_value",
    "weight_specs",
]

#: fp32 params kept outside the bf16 buffer (backed up, never rematerialized).
EXTRA_PARAMS = ("head.scale",)
#: Non-param buffers (like MoE's ``expert_bias``); backed up, never rematerialized.
EXTRA_BUFFERS = ("head.logit_bias",)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the tiny decoder-only LM. The defaults make a ~60 k-param model."""

    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 2
    max_seq: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        problems = [f"{n} must be >= 1, got {getattr(self, n)}" for n in ("vocab", "dim", "layers", "heads", "max_seq")
                    if getattr(self, n) < 1]
        if self.heads >= 1 and self.dim % self.heads:
            problems.append(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")
        if problems:
            raise ConfigError(problems, "ModelConfig")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden(self) -> int:
        return 4 * self.dim


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One named weight: shape, dtype and what kind of weight it is."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "param" (bf16, in the flat buffer), "fp32_param" or "buffer" (the extras)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def weight_specs(cfg: ModelConfig) -> tuple[WeightSpec, ...]:
    """Every weight of the model, in buffer order. The engine serves exactly these."""
    d, h, v = cfg.dim, cfg.hidden, cfg.vocab
    bf = torch.bfloat16
    specs = [WeightSpec("embed.weight", (v, d), bf, "param"), WeightSpec("pos.weight", (cfg.max_seq, d), bf, "param")]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        specs += [
            WeightSpec(p + "ln1.weight", (d,), bf, "param"),
            WeightSpec(p + "ln1.bias", (d,), bf, "param"),
            WeightSpec(p + "attn.qkv.weight", (3 * d, d), bf, "param"),
            WeightSpec(p + "attn.proj.weight", (d, d), bf, "param"),
            WeightSpec(p + "ln2.weight", (d,), bf, "param"),
            WeightSpec(p + "ln2.bias", (d,), bf, "param"),
            WeightSpec(p + "mlp.fc1.weight", (h, d), bf, "param"),
            WeightSpec(p + "mlp.fc2.weight", (d, h), bf, "param"),
        ]
    specs.append(WeightSpec("head.weight", (v, d), bf, "param"))
    specs += [WeightSpec(n, (d,), torch.float32, "fp32_param") for n in EXTRA_PARAMS]
    specs += [WeightSpec(n, (v,), torch.float32, "buffer") for n in EXTRA_BUFFERS]
    return tuple(specs)


def initial_value(spec: WeightSpec, gen: torch.Generator) -> torch.Tensor:
    """The initial value of one weight: norms' scales 1, biases 0, the rest small normal noise."""
    if spec.name.endswith(("ln1.weight", "ln2.weight")) or spec.name == "head.scale":
        return torch.ones(spec.shape)
    if spec.name.endswith(".bias"):
        return torch.zeros(spec.shape)
    return torch.randn(spec.shape, generator=gen) * 0.02


@dataclass(slots=True)
class KVCache:
    """Keys and values per layer, ``[batch, heads, max_seq, head_dim]`` each (views into one buffer)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


def forward(
    w: Mapping[str, torch.Tensor],
    tokens: torch.Tensor,
    cfg: ModelConfig,
    *,
    cache: KVCache | None = None,
    start: int = 0,
) -> torch.Tensor:
    """Logits (fp32) for ``tokens`` ``[batch, T]`` at positions ``start..start+T``.

    Weights are upcast to fp32 at use, so trainer and engine compute alike.
    With ``cache``, keys and values are written at those positions and the
    queries attend to everything cached before them (incremental decoding).
    """
    b, t = tokens.shape
    d, nh, hd = cfg.dim, cfg.heads, cfg.head_dim
    x = F.embedding(tokens, w["embed.weight"].float()) + w["pos.weight"].float()[start : start + t]
    q_pos = torch.arange(start, start + t).unsqueeze(1)
    mask = torch.arange(start + t).unsqueeze(0) <= q_pos  # [t, start+t]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        hdn = F.layer_norm(x, (d,), w[p + "ln1.weight"].float(), w[p + "ln1.bias"].float())
        q, k, v = F.linear(hdn, w[p + "attn.qkv.weight"].float()).view(b, t, 3, nh, hd).permute(2, 0, 3, 1, 4)
        if cache is not None:
            cache.k[i][:b, :, start : start + t] = k
            cache.v[i][:b, :, start : start + t] = v
            k, v = cache.k[i][:b, :, : start + t], cache.v[i][:b, :, : start + t]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + F.linear(att.transpose(1, 2).reshape(b, t, d), w[p + "attn.proj.weight"].float())
        hdn = F.layer_norm(x, (d,), w[p + "ln2.weight"].float(), w[p + "ln2.bias"].float())
        x = x + F.linear(F.gelu(F.linear(hdn, w[p + "mlp.fc1.weight"].float())), w[p + "mlp.fc2.weight"].float())
    x = F.layer_norm(x, (d,)) * w["head.scale"]
    return F.linear(x, w["head.weight"].float()) + w["head.logit_bias"]
