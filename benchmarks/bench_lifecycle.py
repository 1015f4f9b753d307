"""Offload and wake against the hardware limits, verification speed, lifecycle overhead: one JSON file.

The same as ``miles-fsm bench``; the work lives in the ``lifecycle/`` package
beside this script (``lifecycle/__init__.py`` says what each module measures):

    python benchmarks/bench_lifecycle.py --out bench-out/lifecycle.json          # CPU: reference stack
    python benchmarks/bench_lifecycle.py --device cuda --out /tmp/lifecycle.json  # GPU: megatron + torch_memory_saver
    python benchmarks/plot.py bench-out/lifecycle.json --out docs/img             # the figures
"""

from __future__ import annotations

import sys

from lifecycle.cli import main

if __name__ == "__main__":
    sys.exit(main())
