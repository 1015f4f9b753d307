"""The loop's command line, its JSON, and the verdict: every check over every cycle, with the figures beside it."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_fsm.apps.colocated.config import FULL, LOAD_FORMATS, SMOKE, LoopConfig, missing_requirements
from miles_fsm.states import Strategy

__all__ = ["add_loop_arguments", "config_from_args", "parse_args", "summarize", "write_json"]


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the JSON to write (the server log goes beside it)")
    p.add_argument("--smoke", action="store_true",
                   help="a 53 M-param GPT, 1 cycle, rematerialize only: the whole path, quickly")
    p.add_argument("--cycles", type=int, default=None, help="cycles per (strategy, push format) (default 3; smoke 1)")
    p.add_argument("--strategy", choices=[s.value for s in Strategy], action="append", default=None,
                   help="repeatable (default: both; smoke: rematerialize)")
    p.add_argument("--startup-timeout", type=float, default=420.0, help="seconds for the server to come up")
    p.add_argument("--profile-trace", type=Path, default=None, help="also write the profiled push's Chrome trace here")
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="each lifecycle's traces in a folder of its own here (default: a temporary folder)")


def config_from_args(args: argparse.Namespace) -> LoopConfig:
    strategies = tuple(Strategy(s) for s in (args.strategy or (["rematerialize"] if args.smoke else
                                                               ["rematerialize", "backup"])))  # fmt: skip
    return LoopConfig(shape=SMOKE if args.smoke else FULL, cycles=(1 if args.smoke else 3) if args.cycles is None else args.cycles,
                      strategies=strategies, load_formats=LOAD_FORMATS, out=args.out,
                      startup_timeout_s=args.startup_timeout, profile_trace=args.profile_trace,
                      trace_dir=args.trace_dir)  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> tuple[LoopConfig, list[str]]:
    """The config, and why this host cannot run it (empty when it can)."""
    p = argparse.ArgumentParser(prog="gpu_colocated", description="Megatron and SGLang on one GPU through the "
                                "lifecycle (issue 26): checks and figures as one JSON")  # fmt: skip
    add_loop_arguments(p)
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    return cfg, cfg.problems() + [f"needs {m}" for m in missing_requirements()]


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def _cycles(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for run in result["runs"] for c in run["cycles"]]


def _check(ok: bool, **figures: Any) -> dict[str, Any]:
    return {"ok": bool(ok), **figures}


def _memory_check(result: dict[str, Any]) -> dict[str, Any]:
    """PAUSED frees the trainer's three tags, less what the engine takes back (its weights and KV cache)."""
    rows = []
    for c in _cycles(result):
        m = c["memory"]
        tags = sum(t["bytes"] for t in m["trainer_tags"].values())
        expected = 0.9 * tags - result["memory"]["engine_bytes"]
        resident = {k: t["resident_in_paused"] for k, t in m["trainer_tags"].items()}
        rows.append({"paused_minus_training": m["paused_minus_training"], "at_least": expected,
                     "trainer_tag_bytes": tags, "tags_resident_in_paused": resident,
                     "trainer_residue_in_paused": m["trainer_residue_in_paused"],
                     "ok": m["paused_minus_training"] >= expected and not any(resident.values())})  # fmt: skip
    return _check(bool(rows) and all(r["ok"] for r in rows), cycles=rows)


REQUEST, SERIALIZE, FLATTEN = "update_weights_from_tensor request", "serialize (pickle + base64)", "flatten bucket (copy)"


def exclusive_phases(phases: dict[str, float]) -> dict[str, float]:
    """The push's timed phases made disjoint, so that their shares add up to at most the push.

    The timers nest: the request serializes the tensors, and serializing a
    flattened bucket flattens it first. What is left of a request once it is
    serialized is the engine's side, "engine load".
    """
    out = dict(phases)
    serialize = out.get(SERIALIZE, 0.0)
    if SERIALIZE in out:
        out[SERIALIZE] = serialize - out.get(FLATTEN, 0.0)
    if REQUEST in out:
        out["engine load (request minus serialize)"] = out.pop(REQUEST) - serialize
    return out


def speed_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Push GB/s against the device-copy limit; each phase's share of the push; the guard + trace share."""
    limit = result.get("limits", {}).get("device_copy_GBps")
    out: dict[str, Any] = {"device_copy_GBps": limit, "runs": []}
    for run in result["runs"]:
        cycles = [c for c in run["cycles"] if c["profile"] is None] or run["cycles"]
        if not cycles:
            continue
        push_s = sum(c["push"]["s"] or 0.0 for c in cycles)
        nbytes = sum(c["push"]["bytes"] for c in cycles)
        phases: dict[str, float] = {}
        for c in cycles:
            for k, v in c["push"]["phases_s"].items():
                phases[k] = phases.get(k, 0.0) + v
        phases = exclusive_phases(phases)
        shares = {k: v / push_s for k, v in sorted(phases.items(), key=lambda kv: -kv[1])} if push_s else {}
        gbps = nbytes / push_s / 1e9 if push_s else None
        out["runs"].append({
            "run": f"{run['strategy']}/{run['load_format']}", "push_GBps": gbps,
            "vs_device_copy": gbps / limit if gbps and limit else None,
            "push_phase_shares": shares, "bottleneck": next(iter(shares), None),
            "guard_and_trace_share": sum(c["guard_and_trace_s"] for c in cycles) / sum(c["lifecycle_s"] for c in cycles),
        })  # fmt: skip
    return out


def _engine_memory_check(result: dict[str, Any]) -> dict[str, Any]:
    """SGLang's release and resume, measured by the device's bytes in use: what each tag freed and took
    back, per run in order; ok when every run measured both tags each cycle and no drift was warned."""
    per_run, ok = [], bool(result.get("runs"))
    for run in result.get("runs", []):
        rows = run.get("engine_memory", [])
        figures: dict[str, dict[str, list[int]]] = {}
        for r in rows:
            moved = r["in_use_before"] - r["in_use_after"] if r["op"] == "release" else r["in_use_after"] - r["in_use_before"]
            figures.setdefault(r["tag"], {}).setdefault("freed" if r["op"] == "release" else "taken", []).append(moved)
        cycles = len(run.get("cycles", []))
        measured = all(len(figures.get(t, {}).get("taken", [])) >= cycles for t in ("weights", "kv_cache"))
        ok &= measured and not run.get("drift_warnings")
        per_run.append({"run": f"{run['strategy']}/{run['load_format']}", "bytes": figures,
                        "drift_warnings": run.get("drift_warnings", [])})  # fmt: skip
    return _check(ok, runs=per_run)


def summarize(cfg: LoopConfig, result: dict[str, Any]) -> None:
    """``result["checks"]`` (each with ``ok``) and ``result["ok"]``."""
    cycles = _cycles(result)
    lps = [c["checks"]["logprobs"] for c in cycles]
    wrong = [w for c in cycles for w in c["checks"]["wrong_conversions"].values()]
    changed = [c["checks"]["changed_since_last_cycle"] for c in cycles if c["checks"]["changed_since_last_cycle"]]
    expected = len(cfg.strategies) * len(cfg.load_formats) * cfg.cycles
    params = result.get("model", {}).get("params", 0)
    result["checks"] = {
        "ran_every_cycle": _check("error" not in result and len(cycles) == expected
                                  and all(r["state"] == "TRAINING" for r in result["runs"]),
                                  cycles=len(cycles), expected=expected, error=result.get("error")),
        "model_size": _check(params >= 1e9, params=params),  # FULL only: removed below for the smoke shape
        "logprobs_match_megatron": _check(bool(lps) and all(x["ok"] for x in lps),
                                          worst_max_abs=max((x["max_abs"] for x in lps), default=None),
                                          worst_mean_abs=max((x["mean_abs"] for x in lps), default=None),
                                          tolerance={"mean": cfg.tolerance.mean, "max": cfg.tolerance.max}),
        "wrong_conversion_fails": _check(bool(wrong) and all(w["caught"] for w in wrong),
                                         least_vs_right_mean=min((w["vs_right_mean"] for w in wrong), default=None),
                                         margin=cfg.tolerance.margin),
        "weights_checker_matches": _check(bool(cycles) and all(c["push"]["engine_checksums_verified"] > 0
                                                               for c in cycles)),
        "logprobs_change_after_train_step": _check(bool(changed) and all(x["ok"] for x in changed),
                                                   least_mean_abs=min((x["mean_abs"] for x in changed), default=None)),
        "sha256_verified_every_cycle": _check(bool(cycles) and all(c["verified_sha256"] for c in cycles)),
        "memory_paused_vs_training": _memory_check(result),
        "engine_memory_measured_without_drift": _engine_memory_check(result),
        "server_stopped": _check(result.get("server", {}).get("stopped", False)),
    }  # fmt: skip
    if cfg.shape is not FULL:
        del result["checks"]["model_size"]
    result["speed"] = speed_summary(result)
    result["machine"] = _machine()
    result["config"] = {"shape": cfg.shape.hf_config(), "cycles": cfg.cycles, "prompts": cfg.prompts, "seq": cfg.seq,
                        "lr": cfg.lr, "init_std": cfg.init_std, "strategies": [s.value for s in cfg.strategies],
                        "load_formats": [f or "tensors" for f in cfg.load_formats], "smoke": cfg.shape is SMOKE}  # fmt: skip
    result["ok"] = all(c["ok"] for c in result["checks"].values())


def _machine() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            **{n: v(n) for n in ("sglang", "megatron-core", "torch-memory-saver", "miles-fsm")}}  # fmt: skip
