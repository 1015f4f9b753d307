"""The whole guarded path (planning + intent + guard) against a bare all-reduce, at 69 to 10 000 tensors.

    python benchmarks/bench_guard.py --out benchmarks/results/guard_cpu.json [--tensors 69 1000 10000]
        [--ranks 2] [--runs 3] [--rounds 7] [--iters 240] [--block 20] [--walked-iters 20]

Per tensor count, in the same processes and on the same gloo group:

- ``bare``: ``all_reduce`` of the guard's two int64 (MAX), what a guard cannot go below;
- ``cached``: ``Lifecycle.agree_on`` with a trainer that has ``structure_version``
  (the tensor set walked once, then served from the cache);
- ``walked``: the same with a trainer without it (the set walked on every
  guarded transition: what every transition paid before issue 18);
- ``tensor_set``: ``trainer.tensor_set()`` alone, the walk itself (local).

A round is a barrier, then ``--iters`` of ``bare`` and of ``cached``
interleaved in blocks of ``--block`` (which side opens alternates from block
to block), so the two sides of a ratio see the same load; then a barrier and
``--walked-iters`` of ``walked`` (a walk of 10 000 tensors costs about 100
all-reduces, so its ratio needs no fine interleaving), then of ``tensor_set``.
A round's figure is the median of its iterations, over ranks the median of
the ranks' figures. Ratios are per round, both sides from that round; the
JSON holds their spread over the rounds of each run, and the spread of the
runs' medians over ``--runs`` launches of fresh processes (between-run noise
is what issue 18 saw).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from machine import describe_machine, ratio_spread, spread
from miles_fsm.launch.local import RankContext, run_ranks

GOAL_RATIO = 1.25  # issue 18: planning + guard <= 1.25x a bare all-reduce at 10 000 tensors


class _StubTrainer:
    """A trainer driver whose ``tensor_set()`` walks ``n`` real (meta) tensors, like a model's params."""

    def __init__(self, n: int) -> None:
        import torch

        from miles_fsm.states import Strategy

        self._strategy = Strategy.REMATERIALIZE
        shapes = ((4096, 1024), (1024,), (1024, 4096), (4096,))
        self._tensors = {f"decoder.layers.{i // 4}.w{i % 4}": torch.empty(shapes[i % 4], dtype=torch.bfloat16,
                                                                          device="meta") for i in range(n)}  # fmt: skip

    strategy = property(lambda self: self._strategy)

    def tensor_set(self) -> Any:
        from miles_fsm.plan import TensorSet

        return TensorSet.of(self._tensors.items())

    def tensors(self) -> dict[str, Any]:
        return self._tensors

    def collectives(self, step: Any) -> tuple[Any, ...]:
        return ()

    def memory_in_use(self) -> None:
        return None

    # The cycle's steps never run here: agree_on guards a train step only.
    backup = restore = copy = get = cast_main_to_params = param_sync = lambda self, *a: None
    pause_memory = resume_memory = named_weights = lambda self, *a: None


class _VersionedStub(_StubTrainer):
    structure_version = property(lambda self: 0)


def _times(fn: Any, iters: int, into: list[float]) -> list[float]:
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        into.append(time.perf_counter() - t0)
    return into


def _interleaved(a: Any, b: Any, iters: int, block: int) -> tuple[float, float]:
    """Medians of ``iters`` calls of ``a`` and of ``b``, run in alternating blocks of ``block``."""
    ta: list[float] = []
    tb: list[float] = []
    for k in range(0, iters, block):
        n = min(block, iters - k)
        for fn, into in ((a, ta), (b, tb)) if (k // block) % 2 == 0 else ((b, tb), (a, ta)):
            _times(fn, n, into)
    return statistics.median(ta), statistics.median(tb)


def _rank(ctx: RankContext) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from miles_fsm import Guard, GuardConfig, Lifecycle, LifecycleConfig
    from miles_fsm.plan import Collective

    torch.set_num_threads(1)
    kw = ctx.kwargs
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    buf = torch.zeros(2, dtype=torch.int64)
    config = LifecycleConfig(guard=GuardConfig(timeout_s=120), run_id="bench-guard")
    # One guard for every lifecycle here: a guard's publisher thread would otherwise be one more per lifecycle.
    guard = Guard.from_group(group, timeout_s=120)
    out: dict[str, Any] = {}
    for n in kw["tensors"]:
        cached = Lifecycle(trainer=_VersionedStub(n), config=config, guard=guard)
        walked = Lifecycle(trainer=_StubTrainer(n), config=config, guard=guard)
        walk_trainer = _StubTrainer(n)
        collectives = (Collective("all_reduce", "dp", "float32", n * 1024),)
        bare = partial(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=group)
        guarded = partial(cached.agree_on, "train", collectives)
        walk_guarded = partial(walked.agree_on, "train", collectives)
        guarded()  # the first walk, and the guard's first all-reduce
        walked.agree_on("train", collectives)
        rounds: dict[str, list[float]] = {"bare": [], "cached": [], "walked": [], "tensor_set": []}
        for _ in range(kw["rounds"]):
            dist.barrier(group=group)
            b, c = _interleaved(bare, guarded, kw["iters"], kw["block"])
            rounds["bare"].append(b)
            rounds["cached"].append(c)
            dist.barrier(group=group)
            rounds["walked"].append(statistics.median(
                _times(walk_guarded, kw["walked_iters"], [])))  # fmt: skip
            rounds["tensor_set"].append(statistics.median(_times(walk_trainer.tensor_set, kw["walked_iters"], [])))
        out[str(n)] = rounds
    return out


def _row(n: int, per_rank: list[dict[str, list[float]]]) -> dict[str, Any]:
    sides = per_rank[0].keys()
    # A round's figure: the median over ranks of each rank's median of that round.
    rounds = {s: [statistics.median(r[s][i] for r in per_rank) * 1e6 for i in range(len(per_rank[0][s]))]
              for s in sides}  # fmt: skip
    return {
        "tensors": n,
        "bare_all_reduce_us": spread(rounds["bare"]),
        "guarded_cached_us": spread(rounds["cached"]),
        "guarded_walked_us": spread(rounds["walked"]),
        "tensor_set_walk_us": spread(rounds["tensor_set"]),
        "ratio_cached": ratio_spread(rounds["cached"], rounds["bare"]),
        "ratio_walked": ratio_spread(rounds["walked"], rounds["bare"]),
        "per_round_us": rounds,
    }


def _over_runs(n: int, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One tensor count across runs (fresh processes each): each run's row, and the spread of their ratios."""
    rows = [next(r for r in run if r["tensors"] == n) for run in runs]
    return {
        "tensors": n,
        "runs": rows,
        "ratio_cached_over_runs": spread(r["ratio_cached"]["median"] for r in rows),
        "ratio_walked_over_runs": spread(r["ratio_walked"]["median"] for r in rows),
    }


def _span(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f} \\[{s['min']:.2f}..{s['max']:.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/guard_cpu.json"))
    ap.add_argument("--tensors", type=int, nargs="+", default=[69, 1000, 10000])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--runs", type=int, default=3, help="launches of fresh rank processes (the spread between runs)")
    ap.add_argument("--rounds", type=int, default=7, help="barrier-separated rounds per run")
    ap.add_argument("--iters", type=int, default=240, help="iterations of bare and of cached per round")
    ap.add_argument("--block", type=int, default=20, help="iterations of one side before the other's")
    ap.add_argument("--walked-iters", type=int, default=20, help="iterations of walked and tensor_set per round")
    args = ap.parse_args()
    if args.rounds < 3 or args.runs < 1:
        ap.error("--rounds must be at least 3 (a ratio's spread needs rounds) and --runs at least 1")
    if not 0 < args.block <= args.iters or args.walked_iters < 1:
        ap.error("--block must be between 1 and --iters, and --walked-iters at least 1")
    console = Console(stderr=True, width=150)
    console.print("[bold]bench_guard[/]: measuring the machine's anchors")
    result: dict[str, Any] = {"benchmark": "guard", "machine": describe_machine(), "runs": args.runs,
                              "rounds": args.rounds, "iters": args.iters, "block": args.block,
                              "walked_iters": args.walked_iters, "goal_ratio_at_10000": GOAL_RATIO,
                              "worlds": []}  # fmt: skip
    table = Table(title="guarded path vs bare all-reduce: run 1's per-round medians, us; ratios median \\[min..max]")
    for col in ("ranks", "tensors", "bare", "cached", "walked", "tensor_set()", "cached/bare (rounds)",
                "cached/bare (runs)", "walked/bare (runs)"):
        table.add_column(col, justify="right")
    for world in args.ranks:
        runs = []
        for k in range(args.runs):
            console.print(f"ranks={world} run {k + 1}/{args.runs}: {args.rounds} rounds x {args.iters} iterations "
                          f"at {args.tensors} tensors")  # fmt: skip
            t0 = time.perf_counter()
            outs = run_ranks(_rank, world, timeout_s=900, kwargs={"tensors": args.tensors, "rounds": args.rounds,
                                                                  "iters": args.iters, "block": args.block,
                                                                  "walked_iters": args.walked_iters})  # fmt: skip
            failed = [o for o in outs if not o.ok]
            if failed:
                console.print(f"[red]ranks={world}: rank failures[/]: {[(o.rank, o.error) for o in failed]}")
                return 1
            runs.append([_row(n, [o.result[str(n)] for o in outs]) for n in args.tensors])
            at = {r["tensors"]: r["ratio_cached"]["median"] for r in runs[-1]}
            console.print(f"  done in {time.perf_counter() - t0:.0f} s; cached/bare by tensors: "
                          + ", ".join(f"{n}: {v:.2f}" for n, v in at.items()))  # fmt: skip
        rows = [_over_runs(n, runs) for n in args.tensors]
        result["worlds"].append({"ranks": world, "rows": rows})
        for row in rows:
            first = row["runs"][0]
            table.add_row(str(world), str(row["tensors"]), f"{first['bare_all_reduce_us']['median']:.0f}",
                          f"{first['guarded_cached_us']['median']:.0f}", f"{first['guarded_walked_us']['median']:.0f}",
                          f"{first['tensor_set_walk_us']['median']:.0f}", _span(first["ratio_cached"]),
                          _span(row["ratio_cached_over_runs"]), _span(row["ratio_walked_over_runs"]))  # fmt: skip
    console.print(table)
    for w in result["worlds"]:
        for r in w["rows"]:
            if r["tensors"] == 10000:
                first, over = r["runs"][0]["ratio_cached"]["median"], r["ratio_cached_over_runs"]
                met = over["max"] <= GOAL_RATIO
                console.print(f"goal, ranks={w['ranks']} (<= {GOAL_RATIO}x at 10 000 tensors): {first:.2f}x in run 1, "
                              f"{over['min']:.2f}..{over['max']:.2f}x over {over['rounds']} runs -> "
                              f"{'[green]met[/]' if met else '[red]not met[/]'}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
