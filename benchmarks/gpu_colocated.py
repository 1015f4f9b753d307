"""Megatron and SGLang on one GPU through the lifecycle: miles' colocated loop, end to end (issue 26).

One trainer process (a 1.1 B Llama-shaped megatron-core GPT, bf16, the
distributed optimizer, its memory under torch_memory_saver tags) and one
SGLang server (``--enable-memory-saver``, dummy weights from a config.json of
the GPT's shape) share the GPU. For each weight strategy (rematerialize,
backup) and each push format (CUDA tensors, a flattened bucket): ``start``,
then 3 cycles of train step, ``offload``, ``pause`` (push the converted
weights, checked against ``/weights_checker``; pause the param buffer),
the engine's generation and logprob checks, ``rematerialize``, ``sync``,
``resume`` (SHA256 of every param). The code is ``miles_fsm.apps.colocated``;
``miles-fsm demo --stack megatron-sglang`` runs the same.

Run from the project root on a CUDA host where sglang, megatron-core and
torch-memory-saver import (the project installed in editable mode)::

    python benchmarks/gpu_colocated.py --smoke --out /tmp/colocated_smoke.json
    python benchmarks/gpu_colocated.py --out benchmarks/results/colocated_h200.json

One JSON (its checks, figures and the limits they are read against) and the
server's log beside it; exit 0 when every check passed, 1 when one failed,
2 when the host cannot run it. ``tests/test_colocated_gpu.py`` runs it.
"""

from __future__ import annotations


if __name__ == "__main__":
    from miles_fsm.apps.colocated.run import main
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # the JSON is written and the server stopped by then
