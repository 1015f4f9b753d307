"""``miles-fsm demo --stack megatron-sglang --trace-dir D`` leaves its traces in D, and prints replay commands that work.

The colocated loop needs a GPU, SGLang and megatron-core; on CPU its run
(``run_loop``) is replaced by one that runs a toy lifecycle per (strategy,
push format) into the folder the loop's own ``lifecycle_trace_dir`` names
under the loop's config, and its checks (``summarize``) by a verdict of
passed. Everything else is the user's path: the demo's flags, the loop's
command line and config, and the lines printed at the end, which are run in
a shell exactly as printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from toy import ToyEngine, ToyTrainer

from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm.apps import colocated
from miles_fsm.apps.cli import main
from miles_fsm.apps.colocated.traces import lifecycle_trace_dir
from miles_fsm.states import CYCLE


def _toy_loop(cfg, result):
    """A lifecycle with a cycle per (strategy, push format), traced where the loop traces its own."""
    result["traces"] = str(cfg.trace_dir)
    for strategy in cfg.strategies:
        for load_format in cfg.load_formats:
            traces = lifecycle_trace_dir(cfg.trace_dir, strategy, load_format)
            result["runs"].append({"strategy": strategy.value, "traces": str(traces)})
            with Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(), config=LifecycleConfig(trace_dir=traces)) as lc:
                lc.start()
                for trigger in CYCLE:
                    lc.fire(trigger)


def _passed(cfg, result):
    result["checks"], result["ok"] = {}, True


@pytest.fixture
def cpu_loop(monkeypatch):
    """The demo's megatron-sglang stack with the GPU loop replaced by ``_toy_loop``, exiting by SystemExit."""
    from miles_fsm.apps.colocated import config, report, run
    from miles_fsm.drivers import tms

    for module in (config, report):
        monkeypatch.setattr(module, "missing_requirements", lambda: [])
    monkeypatch.setattr(run, "run_loop", _toy_loop)
    monkeypatch.setattr(run, "summarize", _passed)
    monkeypatch.setattr(tms, "exit_past_shutdown", lambda code: sys.exit(code))
    for name in ("NCCL_GRAPH_REGISTER", "CUDA_DEVICE_MAX_CONNECTIONS"):  # main sets them if unset: restored after
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    return colocated


def test_the_trace_dir_holds_each_lifecycles_traces_and_the_printed_replays_work(cpu_loop, tmp_path, capfd):
    """``--trace-dir D`` puts every lifecycle's ``rank-0.jsonl`` in ``D/<strategy>_<push format>/`` (they went
    to a temporary folder named only inside the JSON) with the JSON beside them, and the demo prints one
    ``miles-fsm replay`` per lifecycle (it printed none); each, run in a shell as printed, replays OK."""
    trace_dir = tmp_path / "st dir"  # a space: the printed command must quote it
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--stack", "megatron-sglang", "--steps", "2", "--trace-dir", str(trace_dir)])
    out, _ = capfd.readouterr()
    assert exc.value.code == 0, out
    assert (trace_dir / "colocated.json").is_file()
    folders = sorted(p.parent.name for p in trace_dir.glob("*/rank-0.jsonl"))
    assert folders == ["rematerialize_flattened_bucket", "rematerialize_tensors"], out
    commands = re.findall(r"^\s*(miles-fsm replay .*)$", out, re.M)
    assert len(commands) == 2, out
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    for command in commands:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PATH": path})
        assert done.returncode == 0, command + "\n" + done.stdout + done.stderr
        assert done.stdout.startswith("OK"), done.stdout
