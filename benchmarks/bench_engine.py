"""Per-trigger engine overhead: what the machine itself costs around a transition.

    python benchmarks/bench_engine.py --out bench-out/engine.json [--cycles 2000] [--rounds 5]

Drivers that do nothing, one rank, so every microsecond measured is the
engine's: the arrow lookup, planning, the ``transitions`` executor, the
in-flight bookkeeping, trace records and the result objects. Three setups:

- ``no trace``: ``trace_dir=None``;
- ``traced``: every record written and flushed to a real file;
- ``traced + engine``: also an engine driver, so the push and engine memory
  steps run (more steps per transition).

Anchors measured in the same run: a plain ``orjson.dumps`` + ``write(2)``
of a record of the same size (what one trace line costs at the least), and
a bare dict lookup of the arrow (what choosing the transition costs at the
least), and a bare ``transitions`` machine of the same shape with no-op
callbacks (the executor's own share). Rounds alternate setups; the JSON holds every round, the text the
median and the spread (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path



class NullTrainer:
    """A trainer driver that does nothing, in the shape of ``TrainerDriver``."""

    def __init__(self) -> None:
        from miles_fsm import Strategy
        from miles_fsm.plan import TensorSet

        self._strategy = Strategy.REMATERIALIZE
        self._set = TensorSet(())

    @property
    def strategy(self):
        return self._strategy

    def backup(self, tag):
        return None

    def restore(self, tag):
        return None

    def copy(self, src_tag, dst_tag):
        return None

    def get(self, tag):
        return {}

    def cast_main_to_params(self):
        return None

    def param_sync(self):
        return None

    def pause_memory(self, tag):
        return None

    def resume_memory(self, tag):
        return None

    def named_weights(self):
        return []

    def tensors(self):
        return {}

    def tensor_set(self):
        return self._set

    def collectives(self, step):
        return ()

    def memory_in_use(self):
        return None


class NullEngine:
    """An engine driver that does nothing but remember the version."""

    name = "null-engine"

    def __init__(self) -> None:
        self._version = None

    def release_memory(self, tag):
        return None

    def resume_memory(self, tag):
        return None

    def update_weights(self, named, *, version):
        self._version = version

    def weight_version(self):
        return self._version

    def weight_digests(self):
        return None

    def collectives(self, step):
        return ()


def _lifecycle(trace_dir: str | None, engine: bool):
    from miles_fsm import Lifecycle, LifecycleConfig, VerifyConfig

    config = LifecycleConfig(
        trace_dir=None if trace_dir is None else Path(trace_dir),
        verify=VerifyConfig(cycles=0, ci_verifies_every_cycle=False),
    )
    lc = Lifecycle(trainer=NullTrainer(), engine=NullEngine() if engine else None, config=config)
    lc.start()
    return lc


def per_trigger_us(trace_dir: str | None, engine: bool, cycles: int) -> float:
    lc = _lifecycle(trace_dir, engine)
    fire, cycle = lc.fire, lc.cycle
    for trigger in cycle * 50:  # warm-up
        fire(trigger)
    t0 = time.perf_counter()
    for _ in range(cycles):
        for trigger in cycle:
            fire(trigger)
    elapsed = time.perf_counter() - t0
    lc.close()
    return elapsed / (cycles * len(cycle)) * 1e6


def plain_write_us(directory: str, n: int) -> float:
    """orjson.dumps + one write(2) of a record shaped like an action_finished line."""
    import orjson

    path = os.path.join(directory, "plain.jsonl")
    with open(path, "ab", buffering=0) as f:
        t0 = time.perf_counter()
        for i in range(n):
            rec = {
                "v": 2, "rank": 0, "world": 1, "event": "action_finished", "epoch": i, "trigger": "offload",
                "state": "TRAINING", "action": "backup(actor)", "duration_s": 1e-6, "seq": i,
                "mono_ns": time.monotonic_ns(), "wall": time.time(),
            }  # fmt: skip
            f.write(orjson.dumps(rec) + b"\n")
        return (time.perf_counter() - t0) / n * 1e6


def transitions_alone_us(cycles: int) -> float:
    """A bare ``transitions`` machine of the same shape, its four callbacks no-ops: the executor's own cost."""
    import transitions

    class Model:
        pass

    def noop(event):
        return True

    from miles_fsm.states import CYCLE, DEFINITION, State

    states = [s.value for s in State]
    table = [
        {"trigger": t.trigger.value, "source": t.source.value, "dest": t.dest.value, "prepare": [noop],
         "conditions": [noop], "before": [noop], "after": [noop]}
        for t in DEFINITION.transitions
    ]  # fmt: skip
    model = Model()
    machine = transitions.Machine(model=model, states=states, transitions=table, initial=State.TRAINING.value,
                                  auto_transitions=False, send_event=True, on_exception=[noop])  # fmt: skip
    events = [machine.events[t.value].trigger for t in CYCLE]
    t0 = time.perf_counter()
    for _ in range(cycles):
        for fire in events:
            fire(model)
    return (time.perf_counter() - t0) / (cycles * len(events)) * 1e6


def dict_lookup_us(n: int) -> float:
    triggers = ("offload", "pause", "rematerialize", "sync", "resume")
    table = {(s, t): (s, t) for s in range(7) for t in triggers}
    keys = [(i % 7, triggers[i % 5]) for i in range(64)]
    t0 = time.perf_counter()
    for i in range(n):
        table.get(keys[i & 63])
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cycles", type=int, default=2000, help="cycles of 5 triggers per setup and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="", help="a name for this code version (e.g. 'before', 'after')")
    args = ap.parse_args(argv)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.touch()
    except OSError as exc:
        print(f"bench_engine: cannot write --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    setups = {"no trace": (False, False), "traced": (True, False), "traced + engine": (True, True)}
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for name, (traced, engine) in setups.items():
                trace_dir = os.path.join(d, f"r{r}-{name.replace(' ', '_').replace('+', '')}") if traced else None
                row[name] = per_trigger_us(trace_dir, engine, args.cycles)
            row["transitions alone"] = transitions_alone_us(args.cycles)
            row["plain write"] = plain_write_us(d, args.cycles * 5)
            row["dict lookup"] = dict_lookup_us(args.cycles * 50)
            rounds.append(row)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items()), flush=True)
    summary = {}
    for name in rounds[0]:
        values = [row[name] for row in rounds]
        summary[name] = {"median_us": statistics.median(values), "min_us": min(values), "max_us": max(values)}
    print(f"\nper trigger, median over {args.rounds} rounds (min-max):")
    for name, s in summary.items():
        print(f"  {name:16s} {s['median_us']:8.2f} us  ({s['min_us']:.2f}-{s['max_us']:.2f})")
    import miles_fsm

    result = {
        "benchmark": "engine_per_trigger",
        "label": args.label,
        "git": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or None,
        "miles_fsm": miles_fsm.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "cycles": args.cycles,
        "rounds": rounds,
        "summary": summary,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
