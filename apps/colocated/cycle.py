"""One lifecycle over the trainer and the engine, for one weight strategy and one push format, cycle by cycle.

Each cycle: a train step; megatron's own logprobs of the probe batch;
``offload``; host copies of two deliberately wrong conversions; ``pause``
(the engine resumes its weights, the converted weights are pushed and
checked against ``/weights_checker``, the param buffer is paused, the KV
cache resumed); then, while PAUSED, the free device memory, a generation,
the engine's logprobs against megatron's, and each wrong conversion pushed,
checked the same way and put right again; ``rematerialize``, ``sync``,
``resume`` (SHA256 verification of every param).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_fsm.apps.colocated.checks import compare, input_logprobs, mean_of, verdict, wrong_caught
from miles_fsm.apps.colocated.config import LoopConfig
from miles_fsm.apps.colocated.server import SGLangServer
from miles_fsm.apps.colocated.trainer import Gpt, PhaseTimer, megatron_logprobs, train_step, wrong_weights
from miles_fsm.drivers.megatron.convert import Mistake

__all__ = ["Context", "engine_logprobs", "run_cycle", "transition_rows"]


@dataclass(kw_only=True)
class Context:
    """What every cycle of the run shares."""

    cfg: LoopConfig
    server: SGLangServer
    gpt: Gpt
    saver: Any
    ids: torch.Tensor
    timer: PhaseTimer
    probe_driver: Any
    free_with_server: int
    step: int = 0
    previous_engine_lp: list[list[float]] | None = None
    #: The JSON's list of lifecycle runs, each appended when it starts.
    runs: list[dict[str, Any]] = field(default_factory=list)


def _free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def engine_logprobs(ctx: Context) -> list[list[float]]:
    """SGLang's logprobs of input tokens 1..n-1 of every probe prompt, in one batched request."""
    ids = ctx.ids.tolist()
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}  # fmt: skip
    return input_logprobs(ctx.server.url, ctx.server.post("/generate", body, timeout_s=ctx.cfg.request_timeout_s), ids)


def transition_rows(results: list[Any]) -> dict[str, Any]:
    """Per transition: seconds, the guard's, each step's, and the rest (trace records, the machine)."""
    rows = {}
    for r in results:
        steps = {s.name: round(s.duration_s, 6) for s in r.steps}
        rows[r.trigger.value] = {"s": round(r.duration_s, 6), "guard_s": round(r.guard_s, 6), "steps": steps,
                                 "trace_and_machine_s": round(r.duration_s - r.guard_s - sum(steps.values()), 6)}  # fmt: skip
    return rows


def _memory(ctx: Context, free_training: int, free_paused: int) -> dict[str, Any]:
    tags = {tag: {"bytes": sum(r.nbytes for r in ctx.saver.regions(tag)),
                  "resident_in_paused": ctx.saver.resident_bytes([tag])}
            for tag in ("param_buffer", "grad_buffer", "default")}  # fmt: skip
    return {
        "free_training": free_training,
        "free_paused": free_paused,
        "paused_minus_training": free_paused - free_training,
        "trainer_tags": tags,
        # The engine holds the same in PAUSED as when it was up before the trainer was built,
        # so what the trainer still holds in PAUSED, beyond its CUDA context, is the difference.
        "trainer_residue_in_paused": ctx.free_with_server - free_paused,
        "torch_allocated_in_paused": torch.cuda.memory_allocated(),
        "torch_reserved_in_paused": torch.cuda.memory_reserved(),
    }


def _wrong_checks(ctx: Context, copies: dict[Mistake, Any], reference: list[list[float]],
                  right: dict[str, float]) -> dict[str, Any]:
    """Push each wrong conversion, read the engine's logprobs against megatron's, push the right weights back."""
    out = {}
    for mistake, parts in copies.items():
        ctx.probe_driver.update_weights([(n, t.to("cuda")) for n, t in parts["wrong"]],
                                        version=f"wrong-{mistake.value}-{ctx.step}")  # fmt: skip
        stats = compare(engine_logprobs(ctx), reference)
        ctx.probe_driver.update_weights([(n, t.to("cuda")) for n, t in parts["right"]], version=f"right-{ctx.step}")
        out[mistake.value] = {**stats, "caught": wrong_caught(stats, right, ctx.cfg.tolerance),
                              "vs_right_mean": stats["mean_abs"] / max(right["mean_abs"], 1e-9)}  # fmt: skip
    torch.cuda.empty_cache()
    return out


def _paused_checks(ctx: Context, reference: list[list[float]]) -> dict[str, Any]:
    tol = ctx.cfg.tolerance
    t0 = time.perf_counter()
    gen = ctx.server.post("/generate", {"input_ids": ctx.ids[0, :16].tolist(), "sampling_params": {
        "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}, timeout_s=ctx.cfg.request_timeout_s)  # fmt: skip
    generated = len(gen.get("output_ids") or [])
    lp = engine_logprobs(ctx)
    stats = compare(lp, reference)
    previous = ctx.previous_engine_lp
    changed = compare(lp, previous) if previous is not None else None
    ctx.previous_engine_lp = lp
    return {
        "generated_tokens": generated,
        "logprobs": {**stats, "ok": verdict(stats, tol), "tolerance": {"mean": tol.mean, "max": tol.max}},
        "changed_since_last_cycle": None if changed is None else {**changed, "ok": changed["mean_abs"] > tol.mean},
        "engine_mean_logprob": mean_of(lp),
        "s": round(time.perf_counter() - t0, 4),
    }


def run_cycle(ctx: Context, lc: Any, trainer: Any, engine: Any, *, profile: bool) -> dict[str, Any]:
    """One cycle from TRAINING back to TRAINING, with every check; raises if a transition fails."""
    cfg, marks = ctx.cfg, {}
    ctx.step += 1
    t0 = time.perf_counter()
    loss = train_step(ctx.gpt, ctx.ids, step=ctx.step)
    torch.cuda.synchronize()
    marks["train_step"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reference = megatron_logprobs(ctx.gpt, ctx.ids, cfg.shape.vocab)
    marks["megatron_logprobs"] = time.perf_counter() - t0
    free_training = _free()
    results = [lc.offload()]
    t0 = time.perf_counter()
    copies = {m: wrong_weights(ctx.gpt, cfg.shape.vocab, m) for m in Mistake}
    marks["wrong_copies"] = time.perf_counter() - t0
    ctx.timer.take()
    profiled = None
    if profile:
        pause, profiled = _profiled_pause(ctx, lc)
    else:
        pause = lc.pause()
    results.append(pause)
    phases = ctx.timer.take()
    torch.cuda.empty_cache()
    free_paused = _free()
    # Read now, while PAUSED: which trainer tags are resident is the point (the H200 smoke run read it after
    # resume, and so saw every tag resident).
    memory = _memory(ctx, free_training, free_paused)
    checks = _paused_checks(ctx, reference)
    t0 = time.perf_counter()
    checks["wrong_conversions"] = _wrong_checks(ctx, copies, reference, checks["logprobs"])
    marks["wrong_checks"] = time.perf_counter() - t0
    del copies
    results += [lc.rematerialize(), lc.sync(), lc.resume()]
    return _cycle_row(ctx, lc, trainer, engine, results, loss, marks, phases, checks,
                      memory, profiled)  # fmt: skip


def _cycle_row(ctx: Context, lc: Any, trainer: Any, engine: Any, results: list[Any], loss: float,
               marks: dict[str, float], phases: dict[str, float], checks: dict[str, Any], memory: dict[str, Any],
               profiled: Any) -> dict[str, Any]:  # fmt: skip
    rows = transition_rows(results)
    push_s = next((s for n, s in rows["pause"]["steps"].items() if "push_weights" in n), None)
    sums = engine.checksums.get(ctx.server.url)
    total = sum(r["s"] for r in rows.values())
    overhead = sum(r["guard_s"] + r["trace_and_machine_s"] for r in rows.values())
    return {
        "epoch": lc.epoch,
        "state": lc.state.value,
        "verified_sha256": lc.verifies(lc.epoch),
        "loss": loss,
        "outside_lifecycle_s": {k: round(v, 4) for k, v in marks.items()},
        "transitions": rows,
        "lifecycle_s": round(total, 6),
        "guard_and_trace_s": round(overhead, 6),
        "guard_and_trace_share": overhead / total if total else None,
        "push": {"bytes": trainer.pushed_bytes, "s": push_s,
                 "GBps": trainer.pushed_bytes / push_s / 1e9 if push_s else None,
                 "phases_s": {k: round(v, 4) for k, v in phases.items()},
                 "engine_checksums_verified": len(sums.ranks[0]) if sums else 0,
                 "per_engine_checksum": sums.per_engine if sums else None},  # fmt: skip
        "checks": checks,
        "memory": memory,
        "profile": profiled,
    }


def _profiled_pause(ctx: Context, lc: Any) -> tuple[Any, dict[str, Any]]:
    """``pause`` under torch.profiler: the top ops and the push's phases (their ranges are in the profile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = lc.pause()
    rows = sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:25]
    top = [{"name": e.key, "count": e.count, "cpu_total_ms": round(e.cpu_time_total / 1e3, 3),
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            "device_total_ms": round(getattr(e, "device_time_total", 0.0) / 1e3, 3)} for e in rows]  # fmt: skip
    if ctx.cfg.profile_trace is not None:
        prof.export_chrome_trace(str(ctx.cfg.profile_trace))
    return result, {"top_by_cpu_total": top, "trace": str(ctx.cfg.profile_trace) if ctx.cfg.profile_trace else None}
