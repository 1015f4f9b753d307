"""``miles-fsm bench``: offload and wake against the hardware limits, in one JSON file.

One command measures, in the same run:

- the limits: pinned host<->device copy bandwidth each way, device copy
  bandwidth (host memcpy on CPU), the gloo all-reduce latency of 2 ranks
  (and the guard's cost on top of it), SHA256 per core, the cost of one
  trace event (``limits.py``);
- full lifecycle cycles, per strategy: each transition's time, the bytes
  its steps and its memory moves copied, the guard time and trace events
  (``transitions.py``);
- offload (TRAINING -> PAUSED: ``offload`` + ``pause``) and wake (PAUSED ->
  SYNCED: ``rematerialize`` + ``sync``) as GB/s of the bytes that cross to
  or from the host, against the pinned D2H / H2D limit;
- verification: the chunked, pipelined digest beside the per-tensor
  ``.cpu()`` + hashlib path (and the earlier threaded per-tensor one)
  (``verify.py``);
- guard + trace overhead per transition (and, on CPU, in the demo: ``demo.py``);

then the ratios (``report.py``). On CUDA it runs the Megatron driver over
torch_memory_saver (a >= 1.5 B GPT, the optimizer state kept by the driver's
pinned buffers: ``gpu.py``); without CUDA the reference stack on 2 gloo ranks
(``cpu.py``). ``cli.py`` parses the flags and writes the JSON;
``benchmarks/plot.py`` draws the figures from it.

    miles-fsm bench --out bench-out/lifecycle.json
    python benchmarks/bench_lifecycle.py --out ...   # the same

The package is imported as ``lifecycle`` with ``benchmarks/`` on ``sys.path``
(a script in ``benchmarks/`` has it there; ``miles_fsm.apps.bench`` puts it
there), so its modules import each other relatively.
"""
