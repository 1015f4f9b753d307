"""A torchrun worker for tests/test_torchrun.py: ranks_engine.cycles_or_diverge under torchrun."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ranks_engine  # noqa: E402 - needs the path above

from miles_fsm.launch.torchrun import run_under_torchrun  # noqa: E402

if __name__ == "__main__":
    out_dir, kwargs = sys.argv[1], json.loads(sys.argv[2])
    run_under_torchrun(ranks_engine.cycles_or_diverge, kwargs={"timeout_s": 3.0, **kwargs}, out_dir=out_dir)
