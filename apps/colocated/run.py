"""The run: limits, the server, the GPT, one lifecycle per (strategy, push format), the JSON, the verdict.

``main(argv)`` is ``benchmarks/gpu_colocated.py`` and ``miles-fsm demo
--stack megatron-sglang``. The JSON is rewritten after each lifecycle, so a
run cut short still leaves what it measured; the server is stopped on every
way out.
"""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from miles_fsm.apps.colocated.config import LoopConfig
from miles_fsm.apps.colocated.report import FLATTEN, REQUEST, SERIALIZE, parse_args, summarize, write_json
from miles_fsm.apps.colocated.server import SGLangServer, free_port
from miles_fsm.apps.colocated.traces import lifecycle_label, lifecycle_trace_dir, replay_lines

__all__ = ["device_copy_GBps", "main", "run_loop"]


def device_copy_GBps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy on this GPU, bytes copied per second (best of ``repeats``): the push's ceiling."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def _lifecycle(ctx: Any, strategy: Any, load_format: str | None, host: Any, trace_dir: Path,
               profile_cycle: int) -> dict[str, Any]:  # fmt: skip
    """One ``Lifecycle`` from ``start`` through ``cfg.cycles`` cycles; the engine left resident afterwards."""
    import torch

    from miles_fsm.apps.colocated.checks import engine_checksums
    from miles_fsm.apps.colocated.cycle import run_cycle, transition_rows
    from miles_fsm.apps.colocated.trainer import PushTrainer
    from miles_fsm.config import GuardConfig, LifecycleConfig
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.drivers.sglang.driver import HttpConfig, SGLangConfig, SGLangEngineDriver
    from miles_fsm.drivers.sglang.memory import device_memory_probe
    from miles_fsm.states.drift import MemoryDriftWarning
    from miles_fsm.states.lifecycle import Lifecycle

    cfg = ctx.cfg
    expected = functools.partial(_in_phase, ctx.timer, "expected checksums (trainer hashes)", engine_checksums)
    # The engine's release and resume are measured by the device's bytes in use (the trainer waits meanwhile).
    probe = device_memory_probe(torch.cuda.current_device())
    engine = SGLangEngineDriver.http(ctx.server.url, config=SGLangConfig(load_format=load_format,
                                     expected_checksums=expected, memory_probe=probe),
                                     http=HttpConfig(timeout_s=cfg.request_timeout_s))  # fmt: skip
    dcfg = MegatronDriverConfig.from_megatron([ctx.gpt.chunk], ctx.gpt.optimizer, strategy=strategy, ci=True,
                                              optimizer_offload="driver")  # fmt: skip
    trainer = PushTrainer(gpt=ctx.gpt, vocab=cfg.shape.vocab, copy=load_format is None, timer=ctx.timer, config=dcfg,
                          memory=ctx.saver, host=host)  # fmt: skip
    label, traces = lifecycle_label(strategy, load_format), lifecycle_trace_dir(trace_dir, strategy, load_format)
    lc = Lifecycle(trainer=trainer, engine=engine, config=LifecycleConfig(
        guard=GuardConfig(timeout_s=600), verify=dcfg.verify, trace_dir=traces))  # fmt: skip
    out: dict[str, Any] = {"strategy": strategy.value, "load_format": load_format or "tensors", "cycles": [],
                           "state": "INITIAL", "traces": str(traces)}  # fmt: skip
    ctx.runs.append(out)  # in the JSON from now on: a run cut short keeps the cycles it finished
    error: BaseException | None = None
    drift: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always", MemoryDriftWarning)
        warnings.showwarning = _keep_drift(drift, warnings.showwarning)
        try:
            out["start"] = transition_rows([lc.start()])
            for c in range(cfg.cycles):
                row = run_cycle(ctx, lc, trainer, engine, profile=c + 1 == profile_cycle)
                out["cycles"].append(row)
                _say(label, c, row)
        except BaseException as exc:
            error = exc
            raise
        finally:
            out["drift_warnings"] = drift
            out["engine_memory"] = [dict(r) for r in engine.memory_log]
            out["state"] = lc.state.value
            lc.close(error=error)
            if lc.state.value == "TRAINING":
                engine.resume_all()  # the next lifecycle's start releases them again
            engine.close()
    return out


def _keep_drift(drift: list[str], show: Any) -> Any:
    """A ``warnings.showwarning`` that keeps drift warnings for the JSON and shows every other one as before."""
    from miles_fsm.states.drift import MemoryDriftWarning

    def keep(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, MemoryDriftWarning):
            drift.append(str(message))
        else:
            show(message, category, *args, **kwargs)

    return keep


def _say(label: str, c: int, row: dict[str, Any]) -> None:
    lp, push = row["checks"]["logprobs"], row["push"]
    wrong = ", ".join(f"{k} {v['mean_abs']:.3f}" for k, v in row["checks"]["wrong_conversions"].items())
    print(f"[{label}] cycle {c + 1}: loss {row['loss']:.3f}, logprobs max|d| {lp['max_abs']:.4f} "
          f"mean|d| {lp['mean_abs']:.4f}, push {push['bytes'] / 1e9:.2f} GB in {push['s'] or 0:.3f} s, "
          f"wrong conversions mean|d|: {wrong}", flush=True)  # fmt: skip


def _setup(cfg: LoopConfig, server: SGLangServer, timer: Any, result: dict[str, Any]) -> Any:
    """Limits, then the server (up to its memory pool), then the GPT, then the server's warmup."""
    import torch

    from miles_fsm.apps.colocated.checks import mean_of
    from miles_fsm.apps.colocated.cycle import Context, _free
    from miles_fsm.apps.colocated.trainer import build_gpt, megatron_logprobs
    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

    result["limits"] = {"device_copy_GBps": device_copy_GBps()}
    free_base = _free()
    server.launch()
    print(f"server launched: {' '.join(server.argv[1:])}", flush=True)
    server.wait("/model_info", cfg.startup_timeout_s)
    free_with_server = _free()
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    g = torch.Generator().manual_seed(cfg.seed)
    # The last id of the vocabulary is left out: SGLang 0.5.17 echoed token 4095 of a 4096 vocabulary back as 0
    # in input_token_logprobs (the H200 smoke run), so its logprob would not be the one megatron computes.
    ids = torch.randint(3, cfg.shape.vocab - 1, (cfg.prompts, cfg.seq), generator=g).cuda()
    t0 = time.perf_counter()
    gpt = build_gpt(cfg, saver, ids)
    result["model"] = {"params": gpt.params, "shape": cfg.shape.hf_config(), "optimizer_bytes": gpt.optimizer_bytes,
                       "build_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    print(f"GPT built: {gpt.params / 1e9:.3f} B params in {result['model']['build_s']} s", flush=True)
    server.wait("/health", cfg.startup_timeout_s)
    result["server"]["up_s"] = dict(server.timings)
    result["memory"] = {"free_before_server": free_base, "free_with_server": free_with_server,
                        "engine_bytes": free_base - free_with_server}  # fmt: skip
    _wrap_push_phases(timer)
    ctx = Context(cfg=cfg, server=server, gpt=gpt, saver=saver, ids=ids, timer=timer,
                  probe_driver=_probe_driver(cfg, server), free_with_server=free_with_server)  # fmt: skip
    result["megatron_logprobs_before_training_mean"] = mean_of(megatron_logprobs(gpt, ids, cfg.shape.vocab))
    return ctx


def _probe_driver(cfg: LoopConfig, server: SGLangServer) -> Any:
    """A driver for the wrong-conversion pushes only (it never releases memory; the lifecycle's driver does)."""
    from miles_fsm.apps.colocated.checks import engine_checksums
    from miles_fsm.drivers.sglang.driver import HttpConfig, SGLangConfig, SGLangEngineDriver

    return SGLangEngineDriver.http(server.url, config=SGLangConfig(expected_checksums=engine_checksums),
                                   http=HttpConfig(timeout_s=cfg.request_timeout_s))  # fmt: skip


def _wrap_push_phases(timer: Any) -> None:
    """Time the push's parts in this process: serializing, each request, the engine's and the trainer's hashes."""
    from miles_fsm.drivers.sglang import http, payload

    timer.wrap(http, "serialize_named_tensors", SERIALIZE)
    timer.wrap(payload, "flattened_bucket", FLATTEN)
    for attr, name in (("update_from_tensor", REQUEST),
                       ("checksums", "weights_checker (engine hashes)"), ("flush_cache", "flush_cache"),
                       ("pause_generation", "pause/continue generation"),
                       ("continue_generation", "pause/continue generation"), ("version", "read weight version")):
        timer.wrap(http.HttpTransport, attr, name)  # fmt: skip


def run_loop(cfg: LoopConfig, result: dict[str, Any]) -> None:
    """Everything, the server stopped on every way out; ``result`` filled as it goes."""
    import torch
    import torch.distributed as dist

    from miles_fsm.apps.colocated.trainer import PhaseTimer
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig

    workdir = Path(tempfile.mkdtemp(prefix="miles-fsm-colocated-"))  # the server's model config
    # Each lifecycle's rank traces, one folder each, for `miles-fsm replay` (``traces``).
    traces = cfg.trace_dir if cfg.trace_dir is not None else workdir / "traces"
    result["traces"] = str(traces)
    timer = PhaseTimer()
    log_dir = cfg.log_dir or cfg.out.parent
    server = SGLangServer(config=cfg.server_config, workdir=workdir, log_path=log_dir / f"{cfg.out.stem}_server.log",
                          mem_fraction=cfg.mem_fraction_static)  # fmt: skip
    result["server"] = {"argv": server.argv[1:], "log": str(server.log_path)}
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ctx = _setup(cfg, server, timer, result)
        ctx.runs = result["runs"]
        host = HostCopies(config=PinnedConfig())
        first = True
        for strategy in cfg.strategies:
            for load_format in cfg.load_formats:
                _lifecycle(ctx, strategy, load_format, host, traces, cfg.profile_cycle if first else 0)
                first = False
                write_json(cfg.out, result)
    except SystemExit as exc:
        result["error"] = {"type": "SystemExit", "message": f"stopped by a signal (exit {exc.code})"}
        raise
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[-4000:],
                           "traceback": traceback.format_exc()[-6000:], "server_log_tail": server.log_tail(40)}  # fmt: skip
        print(f"FAILED: {type(exc).__name__}: {exc}\n--- server log tail ---\n{server.log_tail(40)}", flush=True)
    finally:
        timer.unwrap()  # the push's timers patch the driver's modules for this process
        server.stop()
        result["server"]["stopped"] = not server.alive()
        dist.destroy_process_group()


def _in_phase(timer: Any, name: str, fn: Any, *args: Any) -> Any:
    with timer.phase(name):
        return fn(*args)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the loop; 0 when every check passed, 1 when one failed, 2 when this host cannot run it."""
    cfg, problems = parse_args(argv)
    if problems:
        print("gpu_colocated: " + "; ".join(problems), flush=True)
        return 2
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # a known hang after a resume (stack-facts)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    result: dict[str, Any] = {"benchmark": "gpu_colocated", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}
    t0 = time.monotonic()
    # A TERM (a time limit) unwinds like an error, so the server, which runs in a session of its own and
    # would outlive this process, is stopped on the way out, and the JSON says how far the run got.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        run_loop(cfg, result)
    finally:
        signal.signal(signal.SIGTERM, previous)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        summarize(cfg, result)
        write_json(cfg.out, result)
    failed = [name for name, c in result["checks"].items() if not c["ok"]]
    print(f"wrote {cfg.out}; checks failed: {failed or 'none'}", flush=True)
    replays = replay_lines(result["runs"])
    if replays:
        print(f"traces: {result.get('traces')}, one folder per lifecycle; replay each with:", flush=True)
        for line in replays:
            print(f"  {line}", flush=True)
    return 0 if result["ok"] else 1
