"""Figures for docs/benchmarks.md from ``miles-fsm bench`` JSON files (measuring and plotting are separate).

    python benchmarks/plot.py benchmarks/results/lifecycle_h200.json benchmarks/results/lifecycle_cpu.json \\
        --before benchmarks/results/gpu_megatron_h200.json --out docs/img

Writes, per input, ``lifecycle_<device>_phases.png`` (offload and wake GB/s
per cycle against the measured limit) and ``lifecycle_<device>_verify.png``
(the three verification paths); with ``--before`` (the gpu_megatron JSON of
the code before issue 8), ``lifecycle_h200_before_after.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(result: dict[str, Any]) -> str:
    return "h200" if result["device"] == "cuda" else "cpu"


def plot_phases(result: dict[str, Any], out: Path) -> Path:
    """GB/s of offload and wake per cycle and strategy, with the limit each is compared with."""
    strategies = result["run"]["strategies"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, phase in zip(axes, ("offload", "wake")):
        limit = None
        for strategy, data in strategies.items():
            cycles = data["cycles"]
            xs = [c["epoch"] for c in cycles]
            ys = [c[phase]["GBps"] for c in cycles]
            ax.plot(xs, ys, marker="o", label=strategy)
            limit = cycles[-1][phase]["limit_GBps"]
        if limit:
            ax.axhline(limit, color="k", linestyle="--", linewidth=1, label=f"limit {limit:.1f} GB/s")
            ax.axhline(0.9 * limit, color="grey", linestyle=":", linewidth=1, label="90% of limit")
        wake_load = result["run"].get("wake_load")
        if phase == "wake" and wake_load:
            mapped = wake_load["just_mapped"]["GBps"]
            ax.axhline(mapped, color="tab:red", linestyle="-.", linewidth=1,
                       label=f"H2D right after mapping {mapped:.1f} GB/s")
        ax.set_title(f"{phase} ({'D2H' if phase == 'offload' else 'H2D'})" if result["device"] == "cuda" else phase)
        ax.set_xlabel("cycle (1-2 verified, first allocates the host buffers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("GB/s of bytes crossing to/from the host")
    machine = result["machine"].get("gpu") or f"{result['machine']['cpus']}-core CPU"
    fig.suptitle(f"miles-fsm bench, {machine}, {result['when'][:10]}")
    fig.tight_layout()
    path = out / f"lifecycle_{_label(result)}_phases.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_verify(result: dict[str, Any], out: Path) -> Path:
    """The three digest paths over the same tensors, GB/s."""
    v = result["run"]["verification"]
    names = ["naive_per_tensor", "threaded_per_tensor", "pipelined"]
    labels = ["per tensor .cpu()\n+ hashlib", "per tensor,\nthread pool (before)", "chunked, pinned,\npipelined (now)"]
    values = [v[f"{n}_GBps"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar(labels, values, color=["#bbb", "#999", "#2a7"])
    for b, val in zip(bars, values):
        ax.annotate(f"{val:.2f}", (b.get_x() + b.get_width() / 2, val), ha="center", va="bottom", fontsize=9)
    ax.axhline(result["limits"]["sha256_all_cores_GBps"], color="k", linestyle="--", linewidth=1,
               label=f"SHA256 x {min(16, result['machine']['cpus'])} cores")
    ax.set_ylabel("GB/s")
    ax.set_title(f"verification of {v['bytes'] / 1e9:.2f} GB ({v['tensors']} tensors), {v['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"lifecycle_{_label(result)}_verify.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_before_after(after: dict[str, Any], before: dict[str, Any], out: Path) -> Path:
    """Offload and wake seconds per strategy: before (gpu_megatron JSON) vs now (bench JSON)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    rows = []
    for strategy in ("rematerialize", "backup"):
        last = before["strategies"][strategy]["cycles"][-1]
        t = last["transitions_s"]
        steps = last["steps_s"]
        verify = steps.get("record_digests", 0.0)
        rows.append((f"{strategy}\nbefore", t["offload"] + t["pause"] - verify, t["rematerialize"] + t["sync"]))
        s = after["summary"][strategy]
        rows.append((f"{strategy}\nnow", s["offload"]["median_s"], s["wake"]["median_s"]))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="offload (TRAINING->PAUSED)")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="wake (PAUSED->SYNCED)")
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log), verification excluded")
    ax.set_title("1.62 B GPT on one H200: before and after issue 8")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / "lifecycle_h200_before_after.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="miles-fsm bench JSON files")
    p.add_argument("--before", type=Path, help="benchmarks/results/gpu_megatron_h200.json (the code before issue 8)")
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        result = json.loads(path.read_text())
        print(plot_phases(result, args.out))
        print(plot_verify(result, args.out))
        if args.before is not None and result["device"] == "cuda":
            print(plot_before_after(result, json.loads(args.before.read_text()), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
