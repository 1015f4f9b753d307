"""The ratios docs/benchmarks.md quotes, and the JSON file with everything measured."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .transitions import CYCLE


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios docs/benchmarks.md quotes: steady cycles (after the verified ones) for the data path."""
    summary: dict[str, Any] = {}
    for strategy, data in result["run"]["strategies"].items():
        cycles = data["cycles"]
        steady = [c for c in cycles if not c["verified"]] or cycles[1:] or cycles
        entry: dict[str, Any] = {}
        for phase in ("offload", "wake"):
            vals = [c[phase] for c in steady]
            entry[phase] = {
                "median_s": statistics.median(v["data_path_s"] for v in vals),
                "bytes": vals[-1]["host_bytes_crossed"],
                "median_GBps": statistics.median(v["GBps"] for v in vals if v["GBps"] is not None)
                if any(v["GBps"] for v in vals) else None,
                "limit_GBps": vals[-1]["limit_GBps"],
            }
            g, lim = entry[phase]["median_GBps"], entry[phase]["limit_GBps"]
            entry[phase]["vs_limit"] = g / lim if g and lim else None
            entry[phase]["first_cycle_s"] = cycles[0][phase]["data_path_s"]
        fractions = {
            n: max(c["transitions"][n]["guard_trace_fraction"] for c in steady) for n in CYCLE
        }
        entry["max_guard_trace_fraction"] = fractions
        entry["transitions_median_s"] = {n: statistics.median(c["transitions"][n]["s"] for c in steady) for n in CYCLE}
        entry["host_bytes"] = data["host_bytes"]
        verified = [c for c in cycles if c["verified"] and c.get("verify_share") is not None]
        if verified:  # the share of a whole verified cycle (train step + transitions) that verification takes
            entry["verification_share"] = {
                "cycles": len(verified),
                "median": statistics.median(c["verify_share"] for c in verified),
                "max": max(c["verify_share"] for c in verified),
                "median_of_transitions": statistics.median(c["verify_share_of_transitions"] for c in verified),
                "median_verify_s": statistics.median(c["verify_s"] for c in verified),
                "median_verify_wait_s": statistics.median(c.get("verify_wait_s", 0.0) for c in verified),
                "median_cycle_s": statistics.median(c["cycle_s"] for c in verified),
            }
        summary[strategy] = entry
    v = result["run"]["verification"]
    summary["verification"] = {k: v[k] for k in ("bytes", "pipelined_GBps", "naive_per_tensor_GBps",
                                                 "threaded_per_tensor_GBps", "speedup_vs_naive", "stable")}
    if "speedup_vs_naive_per_round" in v:  # absent from results written before issue 18
        summary["verification"]["speedup_vs_naive_per_round"] = v["speedup_vs_naive_per_round"]
    for key in ("device_GBps", "device_vs_pipelined", "device_launch_s", "scheme"):  # the device digest: issue 27, CUDA only
        if key in v:
            summary["verification"][key] = v[key]
    if "demo" in result:
        summary["demo_max_guard_trace_fraction"] = {
            label: {t: row["max_guard_trace_fraction"] for t, row in d["transitions"].items()}
            for label, d in result["demo"].items()
        }
    return summary


def progress(message: str) -> None:
    """One line per phase of the bench, as it starts or ends (stdout, flushed: ranks print too)."""
    from rich.console import Console

    Console(highlight=False, width=200).print(f"[bold cyan]bench[/] {message}")


def summary_table(summary: dict[str, Any]) -> Any:
    """The summary as a rich table: offload and wake per strategy, then the verification paths."""
    from rich.table import Table

    table = Table(title="miles-fsm bench: steady cycles (medians)")
    for col in ("what", "seconds", "GB/s", "vs limit", "guard+trace, max fraction"):
        table.add_column(col, justify="right")
    for strategy, entry in summary.items():
        if strategy in ("verification", "demo_max_guard_trace_fraction"):
            continue
        worst = max(entry["max_guard_trace_fraction"].values())
        for phase in ("offload", "wake"):
            e = entry[phase]
            table.add_row(f"{strategy} {phase}", f"{e['median_s']:.3f}", _num(e["median_GBps"]), _num(e["vs_limit"]),
                          f"{worst:.4f}")  # fmt: skip
        if "verification_share" in entry:
            share = entry["verification_share"]
            table.add_row(f"{strategy} verification / verified cycle", f"{share['median_verify_s']:.3f}", "",
                          f"{share['median']:.2%} (max {share['max']:.2%})", "")  # fmt: skip
    v = summary["verification"]
    ratio = v.get("speedup_vs_naive_per_round")
    span = f" [{ratio['min']:.2f}..{ratio['max']:.2f}]" if ratio else ""
    table.add_row("verify, pipelined", "", _num(v["pipelined_GBps"]), "", "")
    if "device_GBps" in v:
        table.add_row("verify, on the device", "", _num(v["device_GBps"]), f"{v['device_vs_pipelined']:.1f}x", "")
    table.add_row("verify, naive per tensor", "", _num(v["naive_per_tensor_GBps"]), "", "")
    table.add_row("verify, pipelined / naive", f"{v['speedup_vs_naive']:.2f}x" + span.replace("[", "\\["), "",
                  "", "")  # fmt: skip
    return table


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_result(result: dict[str, Any], out: Path) -> None:
    """The whole result to ``out``; the summary, as a table, to stdout."""
    from rich.console import Console

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    Console(width=120).print(summary_table(result["summary"]))
    print(f"wrote {out}", flush=True)
