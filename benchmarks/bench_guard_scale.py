"""The guard at scale: agree vs a bare all-reduce, the failure reports, and the store, vs world size.

    python benchmarks/bench_guard_scale.py --out benchmarks/results/guard_scale_cpu.json [--ranks 2 4 8 16 32]

Real gloo ranks on this host (``run_ranks``) at each N measure, per round and
behind a barrier: the bare 2-int64 all-reduce and ``Guard.agree`` on the same
group (the guard's own), the divergence report (one rank's intent differs;
entry to ``RankDivergenceError``, slowest rank), the missing-rank report (one
rank never arrives; entry to ``GuardTimeoutError`` minus the guard timeout,
slowest survivor) and the store's ``get``/``set``/``multi_get`` latency with 1
and with N concurrent clients. A model fitted to those figures extrapolates
both reports to 1024 and 8192 ranks from the store operations and collectives
the guard's failure paths issue (the formulas are in the JSON).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from machine import describe_machine, ratio_spread, spread
from miles_fsm.launch.local import RankContext, run_ranks

console = Console(stderr=True)

#: Store operations on the missing-rank path (guard.py ``_missing_report``), after the timeout:
#: every survivor ``add``s the claim at once (a burst of N on one store), the reporter reads
#: ``check`` + ``multi_get`` of N keys once (timed out: no grace polling) and ``set``s the report,
#: the others' ``wait`` returns and they ``get`` it (a second burst of N).
MISSING_FORMULA = "T_missing(N) = 2 * t_op(C=N) + t_check(K=N) + t_multi_get(K=N) + t_op(C=1)"
#: Collectives on the divergence path (guard.py ``_divergence``): one all_gather of F int64 field
#: hashes, then one broadcast of a pickled intent per distinct row (D, 2 for one odd rank).
DIVERGENCE_FORMULA = ("T_divergence(N) = t_all_gather(N, F int64) + D * t_broadcast_object(N) + explain; fitted "
                      "as a + b*f(N), and as R * t_allreduce(N), R the largest measured ratio")


def _intent(epoch: int, strategy: str = "rematerialize") -> Any:
    from miles_fsm.plan import Collective, Intent, TensorSet, TensorSpec

    tensors = TensorSet(tuple(TensorSpec(f"layers.{i}.weight", (1024, 1024), "bfloat16") for i in range(50)))
    return Intent(epoch=epoch, trigger="sync", source="REMATERIALIZED", dest="SYNCED", strategy=strategy,
                  collectives=(Collective("all_gather", "dp", "bfloat16", 50 << 20),), tensors=tensors)


def _times_us(fn: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def _median_us(fn: Any, n: int) -> float:
    return statistics.median(_times_us(fn, n))


def _floor_us(fn: Any, n: int) -> float:
    # One client's op alone: its fastest run is the store's own cost, without the other
    # processes that share this host's cores.
    return min(_times_us(fn, n))


def _rank(ctx: RankContext) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from miles_fsm.errors import GuardTimeoutError, RankDivergenceError
    from miles_fsm.guard.consensus import Guard

    torch.set_num_threads(1)
    kw = ctx.kwargs
    guard = Guard.from_default_group(timeout_s=60)
    group, store, world = guard._group, guard._store, ctx.world
    buf = torch.zeros(2, dtype=torch.int64)
    out: dict[str, Any] = {"bare_us": [], "agree_us": [], "divergence_s": [], "store": {}}
    intent = _intent(1)
    for _ in range(kw["rounds"]):
        dist.barrier(group=group)
        out["bare_us"].append(_median_us(lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group), kw["iters"]))
        dist.barrier(group=group)
        out["agree_us"].append(_median_us(lambda: guard.agree(intent, state="REMATERIALIZED"), kw["iters"]))
    for r in range(kw["div_rounds"]):
        odd = _intent(100 + r, "plain" if ctx.rank == world - 1 else "rematerialize")
        dist.barrier(group=group)
        t0 = time.perf_counter()
        try:
            guard.agree(odd, state="REMATERIALIZED")
        except RankDivergenceError:
            out["divergence_s"].append(time.perf_counter() - t0)
    # The store: one client (rank 0, the others behind a barrier), then all N at once.
    keys = [guard._last_key(r) for r in range(world)]
    dist.barrier(group=group)
    if ctx.rank == 0:
        store.set("bench/one", b"x" * 100)
        out["store"]["set_us_c1"] = _floor_us(lambda: store.set("bench/one", b"x" * 100), 50)
        out["store"]["get_us_c1"] = _floor_us(lambda: store.get("bench/one"), 50)
        out["store"]["check_us_c1"] = _floor_us(lambda: store.check(keys), 50)
        out["store"]["multi_get_us_c1"] = _floor_us(lambda: store.multi_get(keys), 50)
    dist.barrier(group=group)
    out["store"]["get_us_cN"] = _median_us(lambda: store.get("bench/one"), 50)
    out["store"]["multi_get_us_cN"] = _median_us(lambda: store.multi_get(keys), 10)
    dist.barrier(group=group)
    # Last, since it breaks the group: the last rank never comes to the guard.
    if ctx.rank == world - 1:
        while store.add("bench/reported", 0) < world - 1:  # away until every survivor has its error
            time.sleep(0.05)
        return out
    t0 = time.perf_counter()
    try:
        guard.agree(_intent(999), state="REMATERIALIZED", timeout_s=kw["timeout_s"])
    except GuardTimeoutError as exc:
        out["missing_s"] = time.perf_counter() - t0 - kw["timeout_s"]
        out["missing"] = list(exc.missing)
    store.add("bench/reported", 1)
    return out


def _fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = a + b*x, with the RMS residual."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) / n)
    return {"a": a, "b": b, "rms": rms}


def _fit_vs_n(ns: list[int], ys: list[float]) -> dict[str, Any]:
    """Both fits of y vs N (log2 N: tree/ring rounds; N: one host's serial work), the better one picked."""
    fits = {"log2N": _fit([math.log2(n) for n in ns], ys), "N": _fit([float(n) for n in ns], ys)}
    fits["picked"] = min(("log2N", "N"), key=lambda k: fits[k]["rms"])
    return fits


def _at(fits: dict[str, Any], n: int, kind: str | None = None) -> float:
    kind = kind or fits["picked"]
    f = fits[kind]
    return f["a"] + f["b"] * (math.log2(n) if kind == "log2N" else n)


def _one_n(n: int, args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {"rounds": args.rounds, "iters": args.iters, "div_rounds": 3, "timeout_s": args.timeout}
    t0 = time.monotonic()
    out = run_ranks(_rank, n, timeout_s=args.timeout + 240, linger_s=args.timeout + 5, kwargs=kwargs)
    survivors = [o for o in out if o.rank != n - 1]
    bad = [o for o in survivors if not o.ok or "missing_s" not in o.result]
    if bad:
        raise SystemExit(f"N={n}: ranks failed: {[(o.rank, o.error) for o in bad]}")
    res = [o.result for o in survivors]
    rounds = range(args.rounds)
    bare = [statistics.median(r["bare_us"][i] for r in res) for i in rounds]
    agree = [statistics.median(r["agree_us"][i] for r in res) for i in rounds]
    div = [max(r["divergence_s"][i] for r in res) for i in range(3)]
    store0 = res[0]["store"]
    row = {
        "ranks": n,
        "bare_allreduce_us": spread(bare),
        "agree_us": spread(agree),
        "agree_over_bare": ratio_spread(agree, bare),
        "divergence_report_s": spread(div),
        "missing_report_s_after_timeout": spread([r["missing_s"] for r in res]),
        "missing_named": sorted({tuple(r["missing"]) for r in res}),
        "store_us": {
            **{k: v for k, v in store0.items() if k.endswith("_c1")},
            "get_us_cN": statistics.median(r["store"]["get_us_cN"] for r in res),
            "multi_get_us_cN": statistics.median(r["store"]["multi_get_us_cN"] for r in res),
        },
        "wall_s": time.monotonic() - t0,
    }
    console.print(f"N={n:>4}: agree/bare {row['agree_over_bare']['median']:.2f}x "
                  f"(bare {row['bare_allreduce_us']['median']:.0f} us), divergence "
                  f"{row['divergence_report_s']['median'] * 1e3:.0f} ms, missing +"
                  f"{row['missing_report_s_after_timeout']['max'] * 1e3:.0f} ms after timeout, "
                  f"multi_get({n}) {store0['multi_get_us_c1']:.0f} us  [{row['wall_s']:.0f} s]")
    return row


def _model(rows: list[dict[str, Any]], targets: list[int]) -> dict[str, Any]:
    ns = [r["ranks"] for r in rows]
    if len(ns) < 2:
        raise SystemExit("the model needs at least two world sizes (--ranks)")
    st = [r["store_us"] for r in rows]
    # One op's latency with C clients issuing at once: one store thread serves them in turn,
    # so it grows with C, and a burst of C ops is over after about that latency.
    op_c = _fit([1.0] * len(rows) + [float(n) for n in ns],
                [s["get_us_c1"] for s in st] + [s["get_us_cN"] for s in st])
    mget = _fit([float(n) for n in ns], [s["multi_get_us_c1"] for s in st])
    check = _fit([float(n) for n in ns], [s["check_us_c1"] for s in st])
    allreduce = _fit_vs_n(ns, [r["bare_allreduce_us"]["median"] for r in rows])
    divergence = _fit_vs_n(ns, [r["divergence_report_s"]["median"] for r in rows])

    # The divergence report is a fixed few collectives, so it costs a fixed number of bare
    # all-reduces at any N: the largest measured ratio, times the all-reduce at N.
    div_ratio = max(r["divergence_report_s"]["median"] * 1e6 / r["bare_allreduce_us"]["median"] for r in rows)

    def missing_s(n: int) -> float:
        burst = op_c["a"] + op_c["b"] * n
        us = 2 * burst + (check["a"] + check["b"] * n) + (mget["a"] + mget["b"] * n) + (op_c["a"] + op_c["b"])
        return us / 1e6

    at = {}
    for n in targets:
        at[str(n)] = {
            "missing_report_s": missing_s(n),
            "divergence_report_s": _at(divergence, n),
            "divergence_report_s_other_fit": _at(divergence, n, "N" if divergence["picked"] == "log2N" else "log2N"),
            "divergence_report_s_as_allreduces": div_ratio * _at(allreduce, n) / 1e6,
            "bare_allreduce_us": _at(allreduce, n),
            "missing_within_1s": missing_s(n) <= 1.0,
            "divergence_within_1s": _at(divergence, n) <= 1.0,
        }
    measured_goals = {
        str(r["ranks"]): {
            "agree_over_bare_median": r["agree_over_bare"]["median"],
            "agree_within_1.25x": r["agree_over_bare"]["median"] <= 1.25,
            "missing_within_timeout_plus_2s": r["missing_report_s_after_timeout"]["max"] <= 2.0,
            # How many bare all-reduces the divergence report costs: its collectives are a fixed few.
            "divergence_over_allreduce": r["divergence_report_s"]["median"] * 1e6 / r["bare_allreduce_us"]["median"],
        }
        for r in rows
    }
    return {
        "measured_goals": measured_goals,
        "missing_formula": MISSING_FORMULA,
        "divergence_formula": DIVERGENCE_FORMULA,
        "store_op_us_vs_clients": {**op_c, "form": "t_op(C) = a + b*C us (served in turn by one store)"},
        "multi_get_us_vs_keys": {**mget, "form": "a + b*K us"},
        "check_us_vs_keys": {**check, "form": "a + b*K us"},
        "allreduce_us_vs_N": allreduce,
        "divergence_in_allreduces": div_ratio,
        "allreduce_us_for_divergence_within_1s": 1e6 / div_ratio,
        "divergence_s_vs_N": divergence,
        "modelled": at,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/guard_scale_cpu.json"))
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="timed calls per round and side")
    p.add_argument("--timeout", type=float, default=1.0, help="guard timeout of the missing-rank case, s")
    p.add_argument("--extrapolate", type=int, nargs="+", default=[1024, 8192])
    args = p.parse_args()
    machine = describe_machine()
    rows = [_one_n(n, args) for n in args.ranks]
    model = _model(rows, args.extrapolate)
    for n, m in model["modelled"].items():
        console.print(f"modelled N={n}: missing report {m['missing_report_s'] * 1e3:.0f} ms, divergence "
                      f"{m['divergence_report_s'] * 1e3:.0f} ms ({model['divergence_s_vs_N']['picked']} fit)")
    result = {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "goals": {"agree_over_bare_max": 1.25, "reports_at_1024_s": 1.0,
                  "missing_at_measured_s": f"guard timeout ({args.timeout} s) + 2 s"},
        "measured": rows,
        "model": model,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
