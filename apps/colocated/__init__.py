"""Megatron and SGLang on one GPU through the lifecycle: miles' colocated loop, end to end (issue 26).

One trainer process (a Llama-shaped megatron-core GPT, bf16, distributed
optimizer, its memory under torch_memory_saver tags) and one SGLang server
(``--enable-memory-saver``) share one GPU. Each cycle trains a step,
offloads, pushes the HF-converted weights into SGLang, lets it generate, and
rebuilds the params; the engine's logprobs are checked against megatron's
own forward, a wrong conversion must fail that check, ``/weights_checker``
must match, every param comes back bit-exact (SHA256).

Modules: ``config`` (LoopConfig, the shapes, the tolerances), ``checks``
(pure comparisons), ``server`` (the SGLang process), ``trainer`` (the GPT
and its driver), ``cycle`` (one cycle and its checks), ``report`` (flags,
JSON, verdict), ``run`` (``main``). Run it with
``python benchmarks/gpu_colocated.py --out X.json`` or
``miles-fsm demo --stack megatron-sglang``. Importing this package imports
no torch.
"""

from __future__ import annotations

__all__: list[str] = []
