"""Trace cost per record: ``Tracer.emit`` against a plain orjson write of the same line, measured together.

    python benchmarks/bench_trace.py --out benchmarks/results/trace_cpu.json [--records 20000] [--rounds 7]

Both sides write an ``action_finished`` record (the most frequent record of a
trace) with one ``write(2)`` per line to an unbuffered file in the same
directory. The plain side writes the line the tracer writes, field for field:
the same record fields plus the tracer's own (``v``, ``run``, ``rank``,
``world``, ``seq``, ``mono_ns``, ``wall``), from a dict literal built per
line (any writer builds its record) and rendered by ``orjson.dumps``; it
reads no clock (the clocks are constants), takes no lock and runs no
processor. The tracer side is the call ``Lifecycle`` makes after each step.
Within a round the two sides alternate in chunks of ``--chunk`` records, so
the ratio of a round is of two figures measured under the same load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from machine import describe_machine, ratio_spread, spread
from rich.console import Console

from miles_fsm.trace.writer import Tracer

__all__ = ["main"]

_RUN = "20261203-113000-4242-a1b2c3"
_BASE: dict[str, Any] = {"state": "TRAINING", "epoch": 1, "trigger": "offload"}


_NAME, _DURATION, _MOVED, _MEM, _AFTER = "backup(actor)", 0.0012345, 1 << 24, 1 << 30, 1 << 29


def tracer_chunk(emit: Any, n: int) -> float:
    base = _BASE
    name, duration, moved, mem, after = _NAME, _DURATION, _MOVED, _MEM, _AFTER
    t0 = time.perf_counter()
    for _ in range(n):
        # The call Lifecycle makes after each step (miles_fsm.machine).
        emit("action_finished", action=name, duration_s=duration, bytes_moved=moved, host_bytes=None,
             mem_before=mem, mem_after=after, **base)  # fmt: skip
    return time.perf_counter() - t0


def plain_chunk(write: Any, n: int, seq0: int, mono: int, wall: float) -> float:
    # The tracer's line, field for field and in its order, built per line from the same values;
    # the clocks are constants (the tracer's first values), not read.
    base, dumps = _BASE, orjson.dumps
    name, duration, moved, mem, after = _NAME, _DURATION, _MOVED, _MEM, _AFTER
    t0 = time.perf_counter()
    for i in range(seq0, seq0 + n):
        write(dumps({"v": 2, "run": _RUN, "rank": 3, "world": 8, "action": name, "duration_s": duration,
                     "bytes_moved": moved, "host_bytes": None, "mem_before": mem, "mem_after": after, **base,
                     "event": "action_finished", "seq": i, "mono_ns": mono, "wall": wall}) + b"\n")
    return time.perf_counter() - t0


def one_round(root: Path, n: int, chunk: int) -> tuple[float, float, bytes, bytes]:
    """Both sides in alternating chunks of ``chunk`` records, so both see the same load; us per record."""
    root.mkdir(parents=True)
    t = Tracer(root, rank=3, world=8, run=_RUN)
    opened = orjson.loads(t.path.read_bytes())
    tracer_s = plain_s = 0.0
    with open(root / "plain.jsonl", "wb", buffering=0) as f:
        for k in range(0, n, chunk):
            m = min(chunk, n - k)
            if (k // chunk) % 2 == 0:
                tracer_s += tracer_chunk(t.emit, m)
                plain_s += plain_chunk(f.write, m, k + 1, opened["mono_ns"], opened["wall"])
            else:
                plain_s += plain_chunk(f.write, m, k + 1, opened["mono_ns"], opened["wall"])
                tracer_s += tracer_chunk(t.emit, m)
    t.close()
    sample = t.path.read_bytes().split(b"\n")[1]
    plain_line = (root / "plain.jsonl").read_bytes().split(b"\n", 1)[0]
    return tracer_s / n * 1e6, plain_s / n * 1e6, sample, plain_line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "trace_cpu.json")
    p.add_argument("--records", type=int, default=20000, help="records per side per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chunk", type=int, default=500, help="records per side before switching sides")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    machine = describe_machine()
    tracer, plain = [], []
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as d:
        root = Path(d)
        one_round(root / "warm", 2000, args.chunk)
        for r in range(args.rounds):
            tu, pu, sample, plain_line = one_round(root / f"r{r}", args.records, args.chunk)
            tracer.append(tu)
            plain.append(pu)
            console.print(f"round {r + 1}/{args.rounds}: tracer {tu:.2f} us, plain write {pu:.2f} us, "
                          f"ratio {tu / pu:.2f}")
    doc = {
        "benchmark": "trace cost per record: Tracer.emit vs a plain orjson write of the same line",
        "machine": machine,
        "records_per_round": args.records,
        "chunk": args.chunk,
        "record": orjson.loads(sample),
        "line_bytes": len(sample) + 1,
        "plain_line_bytes": len(plain_line) + 1,
        "same_keys": list(orjson.loads(plain_line)) == list(orjson.loads(sample)),
        "plain_side": "orjson.dumps of a dict literal built per line with the tracer's fields in its order (the "
                      "caller's values, the run's constants, seq; the clocks as constants, not read), + newline, "
                      "one write(2) per line on a buffering=0 file; no clock, lock or processor",
        "tracer_us": spread(tracer),
        "plain_write_us": spread(plain),
        "ratio": ratio_spread(tracer, plain),
        "tracer_us_rounds": tracer,
        "plain_write_us_rounds": plain,
        "goal_ratio": 1.5,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    rs = doc["ratio"]
    console.print(f"tracer {doc['tracer_us']['median']:.2f} us vs plain {doc['plain_write_us']['median']:.2f} us: "
                  f"ratio {rs['median']:.2f} (min {rs['min']:.2f}, max {rs['max']:.2f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
