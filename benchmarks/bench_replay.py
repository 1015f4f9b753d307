"""Replay analysis CPU and wall time against a naive orjson parse of the same synthetic traces.

    python benchmarks/bench_replay.py --out benchmarks/results/replay_cpu.json [--ranks 1024] [--rounds 3]

Each rank file has the records ``Lifecycle`` writes, field for field (the
reference strategy with an engine, three guarded transitions per cycle), with
per-rank clock offsets (skew) and per-rank durations. One rank is a
straggler in ``rematerialize`` and the last rank diverges (another tensor
set at one guard, at 90 % of the run), so the analysis takes its slow path
too and must find both. The files are written first, outside every timer,
then ``os.sync()``; they are read from the page cache.

Each file then gets the index its writer would leave at close
(``miles_fsm.replay.index.write_index``, the CPU it costs recorded), and a
second directory holds the same files, hard-linked, without indexes: the
traces of ranks that crashed or hung before close.

Each round measures, in this process, the CPU time (``time.process_time``)
of ``miles_fsm.replay.report.replay(dir, workers=1)`` (listing, reading, folding,
diagnosing) on both directories and of ``orjson.loads`` of every line of the
same files, in rotating order; then the wall time of ``replay(dir)`` on both,
with its own choice of reader processes. Both directories must give the
same diagnosis. The JSON holds the per-round ratios' spread.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from machine import describe_machine, ratio_spread, spread
from rich.console import Console

from miles_fsm.states import DEFINITION, Strategy, Trigger, steps_for

__all__ = ["write_synthetic"]

_GUARDED = {Trigger.PAUSE: "broadcast@engine[4096:bfloat16]", Trigger.REMATERIALIZE: "all_reduce@dp[2:int64]",
            Trigger.SYNC: "all_gather@dp[1048576:bfloat16]"}
_TENSORS = "5f0c3a9e1b2d4c6e8f0a1b2c3d4e5f60"


def _variant(
    transitions: int, world: int, *, seed: int, slow: float = 1.0, diverge_at: int | None = None
) -> bytes:
    """One rank's file as rank 0 (the caller rewrites the rank field)."""
    rnd = random.Random(seed)
    wall = 1.8e9 + rnd.uniform(-2.0, 2.0)  # clock skew between ranks
    mono = rnd.randrange(10**12, 10**13)
    seq = 0
    out: list[bytes] = []
    dumps = orjson.dumps

    def emit(event: str, epoch: int, state: str | None, trigger: str | None, **fields: Any) -> None:
        nonlocal seq
        rec = {"v": 2, "run": "bench", "rank": 0, "world": world, **fields, "epoch": epoch, "state": state, "trigger": trigger,
               "event": event, "seq": seq, "mono_ns": mono, "wall": wall + mono / 1e9}
        seq += 1
        out.append(dumps(rec))

    def tick(s: float) -> None:
        nonlocal mono
        mono += int(s * 1e9)

    machine = DEFINITION.describe(steps=lambda t: [str(x) for x in steps_for(t, Strategy.REMATERIALIZE)])
    emit("trace_opened", 0, None, None, pid=1000, host="node0", rotated_to=None, strategy="rematerialize",
         guard_timeout_s=60.0, machine=machine)
    state, epoch = DEFINITION.initial, 0
    table = {t.source: t for t in DEFINITION.transitions}
    for n in range(transitions):
        t = table[state]
        if t.trigger is Trigger.OFFLOAD:
            epoch += 1
        trig = t.trigger.value
        steps = [str(s) for s in steps_for(t, Strategy.REMATERIALIZE)]
        emit("transition_started", epoch, state.value, trig, dest=t.dest.value, steps=steps)
        t0 = mono
        guard = _GUARDED.get(t.trigger)
        guard_s = 0.0
        if guard is not None:
            tensors = _TENSORS if diverge_at is None or n != diverge_at else "0" * 32
            emit("guard_entered", epoch, state.value, trig, key=rnd.getrandbits(62) if tensors != _TENSORS else
                 hash((epoch, trig)) & (2**62 - 1), collectives=[guard], tensors=tensors)
            guard_s = rnd.uniform(1e-4, 2e-3)
            tick(guard_s)
            emit("guard_passed", epoch, state.value, trig, duration_s=guard_s)
        for step in steps:
            emit("action_started", epoch, state.value, trig, action=step, mem_before=1 << 30)
            if step == "verify":  # inside its step, in the source state, as Lifecycle writes it
                emit("verified", epoch, state.value, trig, tensors=42, scheme="chunked-sha256/v2", waited_s=0.0)
            d = rnd.lognormvariate(-6.0, 0.3) * (slow if t.trigger is Trigger.REMATERIALIZE else 1.0)
            tick(d)
            emit("action_finished", epoch, state.value, trig, action=step, duration_s=d, bytes_moved=1 << 24,
                 host_bytes=None, mem_before=1 << 30, mem_after=1 << 29)
        tick(2e-5)
        emit("transition_finished", epoch, t.dest.value, trig, source=state.value, duration_s=(mono - t0) / 1e9)
        state = t.dest
        tick(1e-4)
    emit("trace_closed", epoch, state.value, None, clean=True)
    return b"\n".join(out) + b"\n"


def write_synthetic(
    root: str | os.PathLike[str],
    *,
    ranks: int,
    transitions: int,
    variants: int = 8,
    straggler: int | None = 1,
    diverge: bool = True,
) -> dict[str, Any]:
    """Write ``rank-<r>.jsonl`` for ``ranks`` ranks; returns what was planted."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    bases = [_variant(transitions, ranks, seed=v) for v in range(variants)]
    special: dict[int, bytes] = {}
    if straggler is not None and straggler < ranks:
        special[straggler] = _variant(transitions, ranks, seed=1000, slow=3.0)
    diverge_at = None
    if diverge and ranks > 1:
        diverge_at = next(n for n in range(int(transitions * 0.9), transitions) if (n - 1) % 5 == 3)  # a sync
        special[ranks - 1] = _variant(transitions, ranks, seed=2000, diverge_at=diverge_at)
    total = 0
    prefix = b'{"v":2,"run":"bench","rank":0,'
    for r in range(ranks):
        data = special.get(r, bases[r % variants])
        data = data.replace(prefix, b'{"v":2,"run":"bench","rank":%d,' % r)
        (root / f"rank-{r}.jsonl").write_bytes(data)
        total += len(data)
    return {"bytes": total, "straggler": straggler, "diverging_rank": ranks - 1 if diverge_at is not None else None,
            "diverge_position": diverge_at}


def naive_parse(root: Path) -> int:
    """``orjson.loads`` of every line of every rank file, nothing kept: the floor the reader is compared with."""
    loads, n = orjson.loads, 0
    for p in sorted(root.glob("rank-*.jsonl")):
        with open(p, "rb") as f:
            for line in f:
                loads(line)
                n += 1
    return n


def write_indexes(root: Path, ranks: int) -> float:
    """The index of every rank file, as each ``Tracer.close()`` writes it; the CPU seconds that took, in all."""
    from miles_fsm.replay.index import write_index

    c0 = time.process_time()
    for r in range(ranks):
        write_index(root / f"rank-{r}.jsonl", r)
    return time.process_time() - c0


def bench(ranks: int, transitions: int, workers: int | None, keep: Path | None, rounds: int,
          console: Console) -> dict[str, Any]:  # fmt: skip
    from miles_fsm.replay.report import replay

    root = Path(tempfile.mkdtemp(prefix=f"replay-bench-{ranks}-", dir=keep))
    try:
        t0 = time.perf_counter()
        planted = write_synthetic(root / "indexed", ranks=ranks, transitions=transitions)
        write_s = time.perf_counter() - t0
        console.print(f"{ranks} ranks x {transitions} transitions: {planted['bytes'] / 1e9:.2f} GB written "
                      f"in {write_s:.1f} s (not timed); writing their indexes")  # fmt: skip
        index_cpu = write_indexes(root / "indexed", ranks)
        (root / "lines").mkdir()
        for r in range(ranks):
            os.link(root / "indexed" / f"rank-{r}.jsonl", root / "lines" / f"rank-{r}.jsonl")
        os.sync()  # no write-back competing with the reads being timed
        console.print(f"  indexes: {index_cpu:.1f} s CPU in all, {index_cpu / ranks * 1e3:.1f} ms per rank's close")
        cpu: dict[str, list[float]] = {"naive": [], "indexed": [], "lines": []}
        wall: dict[str, list[float]] = {side: [] for side in (*cpu, "indexed_default_workers",
                                                              "lines_default_workers")}  # fmt: skip
        lines = 0
        sides = list(cpu)
        for r in range(rounds):
            # Rotate the order, so no side always runs first or on a warmer page cache.
            for side in sides[r % 3:] + sides[: r % 3]:
                c0, w0 = time.process_time(), time.perf_counter()
                if side == "naive":
                    lines = naive_parse(root / "lines")
                else:
                    # In this process (workers=1): its CPU is all in process_time().
                    got = replay(str(root / side), workers=1)
                    if side == "indexed":
                        d = got
                    else:
                        d_lines = got
                cpu[side].append(time.process_time() - c0)
                wall[side].append(time.perf_counter() - w0)
            # The same diagnosis, but for the directory's name in the files' paths, and the note that the lines
            # alone cannot prove an unseen edit (which only the read without indexes gives).
            alone = d_lines.to_json()
            alone["notes"] = [n for n in alone["notes"] if not n.startswith("not provable without the index")]
            if orjson.dumps(d.to_json()).replace(b"/indexed/", b"/") != \
                    orjson.dumps(alone).replace(b"/lines/", b"/"):  # fmt: skip
                raise RuntimeError("replay from the indexes and replay from the lines disagree")
            for side in ("indexed", "lines"):
                w0 = time.perf_counter()
                replay(str(root / side), workers=workers)  # replay's own choice of reader processes: what users see
                wall[f"{side}_default_workers"].append(time.perf_counter() - w0)
            console.print(f"  round {r + 1}/{rounds}: CPU: naive parse {cpu['naive'][-1]:.2f} s, replay "
                          f"{cpu['indexed'][-1]:.2f} s (ratio {cpu['indexed'][-1] / cpu['naive'][-1]:.2f}), without "
                          f"indexes {cpu['lines'][-1]:.2f} s (ratio {cpu['lines'][-1] / cpu['naive'][-1]:.2f}); "
                          f"wall with default workers {wall['indexed_default_workers'][-1]:.2f} s, without "
                          f"indexes {wall['lines_default_workers'][-1]:.2f} s")  # fmt: skip
        # The whole command as a user runs it: interpreter start, imports, JSON out.
        cli_s: dict[str, float] = {}
        for side in ("indexed", "lines"):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "miles_fsm", "replay", str(root / side), "--json"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)  # fmt: skip
            cli_s[side] = time.perf_counter() - t0
            if proc.returncode != 3:
                raise RuntimeError(f"miles-fsm replay exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    strag = [s for s in d.stragglers if s["straggler"]]
    found = {
        "verdict": d.verdict,
        "culprit": d.culprit,
        "divergence_field": (d.first_divergence or {}).get("field"),
        "stragglers": [(s["transition"], s["slowest_rank"], round(s["ratio"], 2)) for s in strag],
    }
    ok = (
        d.verdict == "divergence"
        and d.culprit is not None
        and d.culprit["ranks"] == [planted["diverging_rank"]]
        and d.culprit["position"] == planted["diverge_position"]
        and any(s[1] == planted["straggler"] for s in found["stragglers"])
    )
    return {
        "ranks": ranks,
        "transitions_per_rank": transitions,
        "lines": lines,
        "bytes": planted["bytes"],
        "write_s": write_s,
        "index_write_cpu_s": index_cpu,
        "index_write_cpu_ms_per_rank": index_cpu / ranks * 1e3,
        "cpu_ratio": ratio_spread(cpu["indexed"], cpu["naive"]),
        "cpu_ratio_without_index": ratio_spread(cpu["lines"], cpu["naive"]),
        "replay_cpu_s": spread(cpu["indexed"]),
        "replay_without_index_cpu_s": spread(cpu["lines"]),
        "naive_parse_cpu_s": spread(cpu["naive"]),
        "naive_parse_wall_s": spread(wall["naive"]),
        "replay_in_process_wall_s": spread(wall["indexed"]),
        "replay_wall_s": spread(wall["indexed_default_workers"]),
        "replay_without_index_wall_s": spread(wall["lines_default_workers"]),
        "replay_workers": workers,
        "rounds_s": {"cpu": cpu, "wall": wall},
        "cli_s": cli_s["indexed"],
        "cli_without_index_s": cli_s["lines"],
        "found": found,
        "found_what_was_planted": ok,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "replay_cpu.json")
    p.add_argument("--ranks", default="1024")
    p.add_argument("--transitions", type=int, default=2000)
    p.add_argument("--workers", type=int, default=None, help="reader processes for the wall time (default: replay's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write the synthetic traces (default: /tmp)")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    machine = describe_machine()
    results = [bench(int(n), args.transitions, args.workers, args.dir, args.rounds, console)
               for n in args.ranks.split(",")]  # fmt: skip
    for r in results:
        c, c0 = r["cpu_ratio"], r["cpu_ratio_without_index"]
        console.print(f"{r['ranks']} ranks: replay CPU / naive parse CPU {c['median']:.2f} (min {c['min']:.2f}, "
                      f"max {c['max']:.2f}), without indexes {c0['median']:.2f}; replay wall "
                      f"{r['replay_wall_s']['median']:.2f} s, without indexes "
                      f"{r['replay_without_index_wall_s']['median']:.2f} s; found planted faults: "
                      f"{r['found_what_was_planted']}")  # fmt: skip
    doc = {
        "benchmark": "replay analysis CPU and wall time vs a naive orjson parse of the same files",
        "machine": machine,
        "naive_side": "orjson.loads of every line of every rank file (iterating the file by lines), in this process",
        "replay_side": "miles_fsm.replay.report.replay(dir, workers=1) in this process for CPU (time.process_time), on "
                       "the files with the indexes their writers leave at close and on the same files without "
                       "(ranks that never closed); replay(dir) with its default reader processes for wall time "
                       "(workers' CPU not counted)",
        "goal": {"cpu_ratio_max": 0.5, "wall_s_max": 20.0},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {args.out}")
    return 0 if all(r["found_what_was_planted"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
