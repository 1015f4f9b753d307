"""The Megatron driver on one GPU: a >= 1.5 B param GPT, real torch_memory_saver regions.

Runs full lifecycle cycles with both strategies on one rank and writes JSON:

- every cycle SHA256-verified by the lifecycle (CI mode) -> ``exact``;
- GPU memory freed in PAUSED, from ``torch.cuda.mem_get_info``;
- restore time: rematerialize (cast + extras restore + param sync) vs the
  pinned backup's restore;
- pause/resume bandwidth per tag vs the pinned host<->device copy limit
  measured in the same run.

Needs CUDA, megatron-core and torch-memory-saver. Usage:

    NCCL_GRAPH_REGISTER=0 python benchmarks/gpu_megatron.py --out /tmp/gpu_megatron.json

Memory placement: the GPT is built plainly; the DDP param and grad buffers
are allocated under the ``param_buffer`` / ``grad_buffer`` tags (no region
backup) through ``ddp_buffers_in_tags``; the optimizer (fp32 master shards,
Adam state, created by the first step) under ``default`` with CPU backup.
Regions are entered one at a time, never nested.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.gpu import gpu_train_step as train_step

os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # a known hang after a resume (stack-facts)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

GiB = 1024**3


class TmsMemory:
    """torch_memory_saver behind the two seams the driver uses: allocate (``empty``) and pause/resume.

    Records, for each pause and resume, the seconds it took and the device
    bytes it freed or took (``mem_get_info``), so bandwidth is measured, not assumed.
    """

    def __init__(self, tms: Any) -> None:
        self._tms = tms
        self.events: list[dict[str, Any]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor:
        with self._tms.region(tag=tag, enable_cpu_backup=backup):
            return torch.zeros(numel, dtype=dtype, device=self.device)

    def _timed(self, op: str, tag: str) -> None:
        torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        getattr(self._tms, op)(tag)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        free1, _ = torch.cuda.mem_get_info()
        self.events.append({"op": op, "tag": tag, "seconds": seconds, "bytes": abs(free1 - free0)})

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        self._timed("pause", tag)  # always synchronized: this benchmark times each call alone

    def resume(self, tag: str) -> None:
        self._timed("resume", tag)


def pinned_limit(nbytes: int = 2 * GiB) -> dict[str, float]:
    """Pinned host<->device copy bandwidth, GB/s, each way (best of 3)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    del dev, host
    torch.cuda.empty_cache()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(args: argparse.Namespace, memory: Any, tms: Any, *, optimizer_backup: bool = True) -> dict[str, Any]:
    """The GPT, its DDP chunk and optimizer; the optimizer under ``default``, with a region
    backup unless ``optimizer_backup`` is False (the driver then keeps it: optimizer_offload="driver")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

    from miles_fsm.drivers.megatron.driver import ddp_buffers_in_tags

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
    )
    model = Float16Module(config, gpt.cuda())
    n_params = sum(p.numel() for p in model.parameters())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=True
    )
    with ddp_buffers_in_tags(memory):
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    torch.cuda.empty_cache()
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
    state = {"chunks": [ddp], "config": config, "params": n_params, "args": args}
    with tms.region(tag="default", enable_cpu_backup=optimizer_backup):
        state["optimizer"] = get_megatron_optimizer(opt_config, [ddp])
        train_step(state, step=0)  # Adam creates its state on the first step: inside the region
    return state


def run_strategy(state: dict[str, Any], memory: TmsMemory, strategy: str, cycles: int) -> dict[str, Any]:
    from miles_fsm.config import GuardConfig, LifecycleConfig
    from miles_fsm.digest import digest_tensors
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.states.lifecycle import Lifecycle

    chunks, optimizer = state["chunks"], state["optimizer"]
    config = MegatronDriverConfig.from_megatron(chunks, optimizer, strategy=strategy, ci=True)
    driver = MegatronTrainer(chunks=chunks, optimizer=optimizer, config=config, memory=memory)
    lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=600), verify=config.verify))
    lc.start()
    out: dict[str, Any] = {"cycles": []}
    for cycle in range(cycles):
        state["last_loss"] = train_step(state, step=cycle + 1)
        torch.cuda.synchronize()
        before = digest_tensors(driver.tensors())
        free_training, total = torch.cuda.mem_get_info()
        memory.events.clear()
        results = [lc.offload(), lc.pause()]
        torch.cuda.synchronize()
        free_paused, _ = torch.cuda.mem_get_info()
        results += [lc.rematerialize(), lc.sync(), lc.resume()]
        after = digest_tensors(driver.tensors())
        steps = {s.name: s.duration_s for r in results for s in r.steps}
        restore_keys = [k for k in steps if k.startswith(("cast_main_to_params", "restore", "param_sync"))]
        out["cycles"].append(
            {
                "epoch": lc.epoch,
                "exact": after == before,
                "freed_in_paused_bytes": free_paused - free_training,
                "device_total_bytes": total,
                "steps_s": steps,
                "restore_s": sum(steps[k] for k in restore_keys),
                "transitions_s": {r.trigger.value: r.duration_s for r in results},
                "memory_events": list(memory.events),
                "actor_host_bytes": driver.host_bytes("actor"),
            }
        )
        last = out["cycles"][-1]
        freed = last["freed_in_paused_bytes"] / GiB
        print(f"[{strategy}] cycle {cycle + 1}: exact={last['exact']} freed={freed:.2f} GiB "
              f"restore={last['restore_s'] * 1e3:.1f} ms", flush=True)
    buffers = [b for c in chunks for b in c.buffers]
    out["param_buffer_bytes"] = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    out["grad_buffer_bytes"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    out["state"] = lc.state.value
    lc.close()
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/benchmarks.md quotes, from the last cycle of each strategy."""
    limit = min(result["pinned_limit"].values())
    summary: dict[str, Any] = {"pinned_limit_GBps": result["pinned_limit"]}
    for strategy, data in result["strategies"].items():
        last = data["cycles"][-1]
        bw = {}
        for ev in last["memory_events"]:
            if ev["bytes"] and ev["seconds"]:
                gbps = ev["bytes"] / ev["seconds"] / 1e9
                bw[f"{ev['op']}:{ev['tag']}"] = {"GBps": gbps, "bytes": ev["bytes"], "vs_pinned_limit": gbps / limit}
        summary[strategy] = {
            "all_exact": all(c["exact"] for c in data["cycles"]),
            "freed_in_paused_GiB": last["freed_in_paused_bytes"] / GiB,
            "restore_ms": last["restore_s"] * 1e3,
            "actor_host_GiB": last["actor_host_bytes"] / GiB,
            "pause_resume": bw,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/miles-fsm/gpu_megatron.json"))
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--min-params", type=float, default=1.5e9)
    parser.add_argument("--hook-mode", choices=["torch", "preload"], default="torch")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = args.hook_mode
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        memory = TmsMemory(tms)
        state = build(args, memory, tms)
        if state["params"] < args.min_params:
            raise SystemExit(f"the GPT has {state['params'] / 1e9:.2f} B params, fewer than --min-params")
        result: dict[str, Any] = {
            "benchmark": "gpu_megatron",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "gpu": torch.cuda.get_device_name(0),
                "host": platform.node(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "megatron_core": _version("megatron-core"),
                "torch_memory_saver": _version("torch-memory-saver"),
                "hook_mode": args.hook_mode,
            },
            "model": {"params": state["params"], "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab},
            "pinned_limit": pinned_limit(),
            "strategies": {},
        }
        for strategy in ("rematerialize", "backup"):
            result["strategies"][strategy] = run_strategy(state, memory, strategy, args.cycles)
        result["summary"] = summarize(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps(result["summary"], indent=2))
        ok = all(result["summary"][s]["all_exact"] for s in ("rematerialize", "backup"))
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    from miles_fsm.drivers.tms import exit_past_shutdown

    exit_past_shutdown(main())  # the JSON is written by then
