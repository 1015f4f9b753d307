"""What one colocated run is: the GPT's shape, the cycles, the probe batch, the tolerances; and what it needs.

The tolerances are fixed before the run, from what bf16 allows (``Tolerance``);
the run reports the measured differences beside them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from miles_fsm.drivers.megatron.llama import LlamaShape
from miles_fsm.states import Strategy

__all__ = ["FULL", "SMOKE", "LOAD_FORMATS", "LoopConfig", "Tolerance", "missing_requirements"]

#: TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads in 4 query groups (GQA), SwiGLU 5632,
#: untied 32000-token embeddings; 1.10 B params. 32000 is a multiple of 128, so megatron pads nothing.
FULL = LlamaShape(layers=22, hidden=2048, heads=32, query_groups=4, head_dim=64, ffn_hidden=5632, vocab=32000,
                  padded_vocab=32000)  # fmt: skip
#: A small one for a quick pass over the whole path (53 M params), wide enough that a wrong
#: conversion still moves the logprobs far beyond bf16's noise (measured on CPU: hidden 1024 puts
#: the gate/up swap at ~60x the bf16-vs-fp32 difference).
SMOKE = LlamaShape(layers=4, hidden=1024, heads=16, query_groups=4, head_dim=64, ffn_hidden=2816, vocab=4096,
                   padded_vocab=4096)  # fmt: skip
#: How the push reaches SGLang: CUDA tensors one by one (None: the model's loader), or a flattened bucket.
LOAD_FORMATS: tuple[str | None, ...] = (None, "flattened_bucket")


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """When SGLang's input-token logprobs match megatron's own forward on the same ids, in nats.

    Both sides compute in bf16 with fp32 softmax, through different kernels
    (SGLang's triton attention and fused RMSNorm/SiLU; megatron's local
    spec in plain torch), so each op rounds at a different place: about
    2^-9 relative per op, adding like a random walk over ~10 ops a layer.
    Measured on CPU (HF Llama, bf16 against fp32, init std 0.02): mean
    |delta| 0.004-0.006, max 0.014-0.026 for 4-8 layers at hidden 512-1024.
    ``mean`` allows ~5x that for 22 layers and two kernel sets; ``max`` is
    10x ``mean``, for the tail over ~1000 tokens. A wrong conversion must
    fail by ``margin``: its mean |delta| at least that many times the right
    one's (on the H200's 1.1 B GPT: the q/k swap 16.6-48x, the gate/up swap 23-62x).
    """

    mean: float = 0.05
    max: float = 0.5
    margin: float = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    """One run of the loop: one trainer process, one SGLang server, one GPU."""

    shape: LlamaShape = FULL
    cycles: int = 3
    strategies: tuple[Strategy, ...] = (Strategy.REMATERIALIZE, Strategy.BACKUP)
    load_formats: tuple[str | None, ...] = LOAD_FORMATS
    #: The probe batch: ``prompts`` random id sequences of ``seq`` tokens; also the train batch.
    prompts: int = 8
    seq: int = 128
    lr: float = 3e-4
    init_std: float = 0.02
    seed: int = 1234
    tolerance: Tolerance = field(default_factory=Tolerance)
    out: Path = Path("colocated.json")
    #: Where each lifecycle's traces go, one folder each (``traces``); None: a temporary folder, named in the JSON.
    trace_dir: Path | None = None
    log_dir: Path | None = None
    startup_timeout_s: float = 420.0
    request_timeout_s: float = 300.0
    mem_fraction_static: float = 0.1
    #: Profile the push of this cycle (1-based) of the first (strategy, format) run; 0: none.
    profile_cycle: int = 1
    profile_trace: Path | None = None

    def problems(self) -> list[str]:
        out = []
        if self.cycles < 1:
            out.append(f"cycles must be >= 1, got {self.cycles}")
        if self.prompts < 1 or self.seq < 2:
            out.append(f"need >= 1 prompt of >= 2 tokens, got {self.prompts} x {self.seq}")
        if self.seq > self.shape.max_positions:
            out.append(f"seq {self.seq} is longer than the model's {self.shape.max_positions} positions")
        if not self.strategies or not self.load_formats:
            out.append("at least one strategy and one load format")
        if not 0 < self.mem_fraction_static < 1:
            out.append(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        return out

    @property
    def server_config(self) -> dict[str, object]:
        """The ``config.json`` the server loads (dummy weights of this shape; the first push gives real ones)."""
        return {**self.shape.hf_config(), "torch_dtype": "bfloat16", "dtype": "bfloat16", "bos_token_id": 1,
                "eos_token_id": 2}  # fmt: skip


def missing_requirements() -> list[str]:
    """What this host lacks for the loop, each as a short phrase; empty when it can run."""
    missing = [f"the {name} package" for name, module in
               (("sglang", "sglang"), ("megatron-core", "megatron"), ("torch-memory-saver", "torch_memory_saver"),
                ("httpx", "httpx")) if importlib.util.find_spec(module) is None]  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        missing.insert(0, "a CUDA GPU")
    return missing
