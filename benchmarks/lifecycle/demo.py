"""Guard + trace overhead per transition in ``miles-fsm demo``, read back from the demo's traces."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def demo_overhead(limits: Mapping[str, Any]) -> dict[str, Any]:
    """Guard + trace overhead per transition in ``miles-fsm demo`` (defaults: 2 ranks, 4 steps), from its traces."""
    import orjson

    from miles_fsm.apps.demo import DemoConfig, run_demo
    from miles_fsm.trace.schema import ACTION_FINISHED, GUARD_PASSED, TRANSITION_FINISHED, TRANSITION_STARTED

    out: dict[str, Any] = {}
    for label, kw in (("default", {}), ("dim256_layers4", {"dim": 256, "layers": 4})):
        with tempfile.TemporaryDirectory(prefix="miles-fsm-demo-") as d:
            result = run_demo(DemoConfig(trace_dir=Path(d), **kw))
            rows: dict[str, list[dict[str, float]]] = {}
            for rank in range(result.config.ranks):
                cur: dict[str, Any] | None = None
                for line in (Path(d) / f"rank-{rank}.jsonl").read_bytes().splitlines():
                    rec = orjson.loads(line)
                    ev = rec["event"]
                    if ev == TRANSITION_STARTED:
                        cur = {"trigger": rec["trigger"], "steps_s": 0.0, "guard_s": 0.0, "events": 1}
                        continue
                    if cur is None:
                        continue
                    cur["events"] += 1
                    if ev == ACTION_FINISHED:
                        cur["steps_s"] += rec["duration_s"]
                    elif ev == GUARD_PASSED:
                        cur["guard_s"] = rec["duration_s"]
                    elif ev == TRANSITION_FINISHED:
                        dur = rec["duration_s"]
                        guard_model = limits["gloo"]["guard_us"] * 1e-6 if cur["guard_s"] > 0 else 0.0
                        trace_s = cur["events"] * limits["trace_event_us"] * 1e-6
                        rows.setdefault(cur["trigger"], []).append(
                            {
                                "s": dur,
                                "guard_wait_s": cur["guard_s"],
                                "guard_trace_fraction": (guard_model + trace_s) / dur,
                                "nonstep_fraction": (dur - cur["steps_s"]) / dur,
                            }
                        )
                        cur = None
        out[label] = {
            "ok": result.ok,
            "config": {"dim": result.config.dim, "layers": result.config.layers, "ranks": result.config.ranks,
                       "steps": result.config.steps},
            "transitions": {
                t: {
                    "n": len(v),
                    "median_s": statistics.median(x["s"] for x in v),
                    "median_guard_trace_fraction": statistics.median(x["guard_trace_fraction"] for x in v),
                    "max_guard_trace_fraction": max(x["guard_trace_fraction"] for x in v),
                    "median_guard_wait_fraction": statistics.median(x["guard_wait_s"] / x["s"] for x in v),
                    "median_nonstep_fraction": statistics.median(x["nonstep_fraction"] for x in v),
                }
                for t, v in rows.items()
            },
        }
    return out
