"""A Llama-shaped megatron-core GPT: its shape, the HF config it converts to, and a builder.

Llama shape means RMSNorm, SwiGLU (a gated ``linear_fc1`` with SiLU), GQA,
rotate-half RoPE (``rotary_interleaved=False``), untied embeddings, no
biases, built from the local layer spec (no TransformerEngine). ``LlamaShape``
holds the facts the converter (``drivers/megatron/convert.py``) needs;
``LlamaShape.from_megatron`` reads them from a live model and refuses one that
is not Llama-shaped (``NotLlamaShapedError``, every problem at once).

``build_llama_gpt`` builds the bare ``GPTModel`` (no ``Float16Module``, no
DDP) under the process group megatron already has; on CPU, call
``miles_fsm.drivers.megatron.cpu.enable()`` first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_fsm.drivers.errors import NotLlamaShapedError
from miles_fsm.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = ["LlamaShape", "build_llama_gpt", "unwrap_gpt"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaShape:
    """The shape of a Llama-shaped GPT, on both sides of the conversion."""

    layers: int
    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    ffn_hidden: int
    #: The HF vocab (the tokenizer's); the megatron embedding may hold more rows (``padded_vocab``).
    vocab: int
    padded_vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 4096

    def __post_init__(self) -> None:
        problems = []
        if self.heads % self.query_groups:
            problems.append(f"{self.heads} attention heads do not split into {self.query_groups} query groups")
        if self.padded_vocab < self.vocab:
            problems.append(f"the padded vocab ({self.padded_vocab}) is smaller than the vocab ({self.vocab})")
        if problems:
            raise NotLlamaShapedError(problems=problems, source="LlamaShape")

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.query_groups

    def megatron_kwargs(self) -> dict[str, Any]:
        """The ``TransformerConfig`` keywords that make a GPT of this shape."""
        import torch.nn.functional as F

        return {
            "num_layers": self.layers,
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_query_groups": self.query_groups,
            "kv_channels": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": False,
            "rotary_interleaved": False,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        }

    def gpt_kwargs(self) -> dict[str, Any]:
        """The ``GPTModel`` keywords (besides ``config`` and the layer spec) that make a GPT of this shape."""
        return {
            "vocab_size": self.padded_vocab,
            "max_sequence_length": self.max_positions,
            "position_embedding_type": "rope",
            # Typed int, but used as a float: no truncation of a fractional theta.
            "rotary_base": self.rope_theta,
            "share_embeddings_and_output_weights": False,
        }

    def hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` of ``LlamaForCausalLM`` for this shape (what SGLang loads)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }

    @classmethod
    def from_megatron(cls, model: torch.nn.Module, *, vocab: int | None = None) -> LlamaShape:
        """The shape of a live GPT (bare, or wrapped in ``Float16Module``/DDP); refused unless Llama-shaped.

        ``vocab`` is the HF vocab, when the embedding holds padding rows beyond it.
        """
        gpt = unwrap_gpt(model)
        c = gpt.config
        problems = _shape_problems(gpt)
        if problems:
            raise NotLlamaShapedError(problems=problems, source=type(gpt).__name__)
        return cls(
            layers=c.num_layers,
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            query_groups=c.num_query_groups or c.num_attention_heads,
            head_dim=c.kv_channels or c.hidden_size // c.num_attention_heads,
            ffn_hidden=c.ffn_hidden_size,
            vocab=gpt.vocab_size if vocab is None else vocab,
            padded_vocab=gpt.vocab_size,
            rope_theta=float(gpt.rotary_base),
            eps=c.layernorm_epsilon,
            max_positions=gpt.max_sequence_length,
        )


def unwrap_gpt(model: torch.nn.Module) -> GPTModel:
    """The ``GPTModel`` inside DDP and ``Float16Module`` wrappers (each keeps it as ``.module``)."""
    seen = model
    while not (hasattr(seen, "decoder") and hasattr(seen, "embedding")):
        inner = getattr(seen, "module", None)
        if inner is None:
            raise NotLlamaShapedError(
                problems=[f"{type(model).__name__} holds no GPTModel (no .decoder and .embedding under .module)"],
                source=type(model).__name__,
            )
        seen = inner
    return seen


def _shape_problems(gpt: Any) -> list[str]:
    import torch.nn.functional as F

    c = gpt.config
    te = sorted({type(m).__module__ for m in gpt.modules() if "transformer_engine" in type(m).__module__})
    checks = (
        (not te, f"it is built from a TransformerEngine layer spec ({', '.join(te)}): build it with "
                 "get_gpt_layer_local_spec()"),
        (not gpt.share_embeddings_and_output_weights,
         "its embeddings are tied to the output layer: build it with share_embeddings_and_output_weights=False"),
        (c.normalization == "RMSNorm", f"normalization is {c.normalization!r}, not 'RMSNorm'"),
        (c.gated_linear_unit and c.activation_func is F.silu, "its MLP is not SwiGLU (gated_linear_unit with F.silu)"),
        (not c.add_bias_linear and not c.add_qkv_bias, "its linear layers have biases (add_bias_linear/add_qkv_bias)"),
        (gpt.position_embedding_type == "rope", f"position embedding is {gpt.position_embedding_type!r}, not 'rope'"),
        (not c.rotary_interleaved, "its RoPE is interleaved: HF Llama rotates halves (rotary_interleaved=False)"),
        (not c.qk_layernorm, "it has q/k layernorms, which Llama has not"),
        (not c.num_moe_experts, "it is a mixture of experts"),
        (not c.multi_latent_attention, "it uses multi-latent attention"),
        (getattr(gpt, "rotary_percent", 1.0) == 1.0, "RoPE covers only part of each head (rotary_percent < 1)"),
        (not getattr(gpt, "rotary_scaling", False), "its RoPE is scaled (Llama 3.1 rope_scaling), which is not converted"),
    )  # fmt: skip
    return [msg for ok, msg in checks if not ok]


def build_llama_gpt(shape: LlamaShape, *, seed: int = 1234, dtype: torch.dtype = torch.float32,
                    init_std: float = 0.02, tp: int = 1) -> GPTModel:  # fmt: skip
    """A bare Llama-shaped ``GPTModel`` (local spec, CPU init), identical for one seed at any TP size.

    Initializes megatron's model parallel state (``tp``-way tensor parallel)
    unless it already is; needs the default process group. A state of
    another TP size is a ``ConfigError``.
    """
    with warnings.catch_warnings():
        # megatron warns at import that Apex/TransformerEngine are absent; not actionable here.
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tp, 1)
        elif (have := parallel_state.get_tensor_model_parallel_world_size()) != tp:
            # Built anyway, the model would be split tp ways over a group of another size.
            raise ConfigError([f"megatron's model parallel state is {have}-way tensor parallel, not tp={tp}: pass "
                               f"tp={have}, or call megatron.core.parallel_state.destroy_model_parallel() first"],
                              what="build_llama_gpt")  # fmt: skip
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            **shape.megatron_kwargs(),
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            params_dtype=dtype,
            bf16=dtype is torch.bfloat16,
            init_method_std=init_std,
        )
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        return GPTModel(config=config, transformer_layer_spec=spec, **shape.gpt_kwargs())
