"""With CUDA: the Megatron driver over torch_memory_saver, a >= 1.5 B bf16 GPT, one GPU.

The optimizer state is kept by the driver's pinned buffers; ``gpu_train_step``
is also the train step of ``benchmarks/gpu_megatron.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .transitions import CYCLE, OFFLOAD, WAKE, phase, trace_events, transition_row, verification_share, verified_waits
from .verify import verification_bench


def _build_gpt(args: argparse.Namespace, saver: Any) -> dict[str, Any]:
    import warnings

    import torch

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

    from miles_fsm.drivers.megatron.driver import coalesce_optimizer_state, ddp_buffers_in_tags

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
    )
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                   max_sequence_length=args.seq)
    model = Float16Module(config, gpt.cuda())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=True
    )
    with ddp_buffers_in_tags(saver):
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    torch.cuda.empty_cache()
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
    state = {"chunks": [ddp], "params": sum(p.numel() for p in model.parameters()), "args": args}
    # The optimizer and its state (Adam creates it on the first step) are built outside any
    # region, then moved into ONE allocation under `default`, without a region backup: the
    # driver keeps the state (optimizer_offload="driver"), and one mapping pauses in a millisecond.
    state["optimizer"] = get_megatron_optimizer(opt_config, [ddp])
    gpu_train_step(state, step=0)

    def allocate(nbytes: int) -> torch.Tensor:
        with saver.region("default", backup=False):
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    state["optimizer_flat_bytes"] = coalesce_optimizer_state(state["optimizer"], allocate)
    torch.cuda.empty_cache()
    return state


def gpu_train_step(state: dict[str, Any], *, step: int) -> float:
    """One bf16 GPT train step on CUDA over ``state["chunks"]`` and ``state["optimizer"]``."""
    import torch

    args = state["args"]
    g = torch.Generator(device="cuda").manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    for chunk in state["chunks"]:
        chunk.zero_grad_buffer()
    state["optimizer"].zero_grad()
    loss = sum(c(tokens, position_ids, None, labels=labels).float().mean() for c in state["chunks"])
    loss.backward()
    for chunk in state["chunks"]:
        chunk.finish_grad_sync()
    ok, _, _ = state["optimizer"].step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped")
    return float(loss.detach())


class _TimedMemory:
    """The saver the driver pauses and resumes through, timing each call (no extra synchronization)."""

    def __init__(self, saver: Any) -> None:
        self._saver = saver
        self.events: list[dict[str, Any]] = []

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        t0 = time.perf_counter()
        self._saver.pause(tag, synchronize=synchronize)
        self.events.append({"op": "pause", "tag": tag, "s": time.perf_counter() - t0})

    def resume(self, tag: str) -> None:
        t0 = time.perf_counter()
        self._saver.resume(tag)
        self.events.append({"op": "resume", "tag": tag, "s": time.perf_counter() - t0})

    def resident_bytes(self, tags: Any = None) -> int:
        return self._saver.resident_bytes(tags)


def run_gpu(args: argparse.Namespace, limits: dict[str, Any]) -> dict[str, Any]:
    import socket

    import torch
    import torch.distributed as dist

    from miles_fsm import GuardConfig, Lifecycle, LifecycleConfig, digest_device
    from miles_fsm.digest import StagingRing, default_threads, digest_tensors
    from miles_fsm.drivers.megatron.driver import OPTIMIZER_KEY, MegatronTrainer
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
    from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="torch"))
    t0 = time.perf_counter()
    state = _build_gpt(args, saver)
    out: dict[str, Any] = {"model": {"params": state["params"], "optimizer_flat_bytes": state["optimizer_flat_bytes"],
                                     "layers": args.layers, "hidden": args.hidden,
                                     "vocab": args.vocab, "build_s": time.perf_counter() - t0},
                           "strategies": {}}
    # One set of pinned buffers for both strategies' drivers.
    host = HostCopies(config=PinnedConfig(streams=args.copy_streams, chunk_bytes=args.chunk_mib << 20))
    chunks, optimizer = state["chunks"], state["optimizer"]
    every = args.verified == "all"
    if digest_device.available():
        # Triton compiles the digest kernel on its first call (or reads its disk cache): not a cycle's cost.
        t0 = time.perf_counter()
        digest_tensors({"warm-up": torch.ones(3, device="cuda")})
        out["device_digest_first_call_s"] = time.perf_counter() - t0
    for strategy in args.strategies:
        config = MegatronDriverConfig.from_megatron(chunks, optimizer, strategy=strategy, ci=False,
                                                    verify_cycles=None if every else args.verified,
                                                    optimizer_offload="driver")  # fmt: skip
        timed = _TimedMemory(saver)
        driver = MegatronTrainer(chunks=chunks, optimizer=optimizer, config=config, memory=timed, host=host)
        trace_dir = Path(tempfile.mkdtemp(prefix="miles-fsm-bench-trace-"))
        lc = Lifecycle(trainer=driver, config=LifecycleConfig(guard=GuardConfig(timeout_s=600), verify=config.verify,
                                                              trace_dir=trace_dir))
        lc.start()
        cycles, results = [], []
        for c in range(args.cycles):
            torch.cuda.synchronize()
            t_train = time.perf_counter()
            gpu_train_step(state, step=c + 1)
            torch.cuda.synchronize()
            train_s = time.perf_counter() - t_train
            check = every or c < args.verified
            opt_before = digest_tensors(driver.optimizer_state()) if check else None
            free_training, _ = torch.cuda.mem_get_info()
            rs, moved, free_paused, marks = {}, {}, None, {}
            log_mark, mem_mark = len(host.log), len(timed.events)
            torch.cuda.synchronize()
            for name in CYCLE:
                mark = len(host.log)
                marks[name] = time.perf_counter()
                rs[name] = lc.fire(name)
                if name in ("pause", "sync"):
                    # Offload and wake end when the device is done: the wake's loads are
                    # queued, not awaited, by the driver.
                    torch.cuda.synchronize()
                    marks[name + "_done"] = time.perf_counter()
                moved[name] = {"save": 0, "load": 0, "memory_save": 0, "memory_load": 0}
                for rec in host.log[mark:]:
                    moved[name][rec.op] += rec.nbytes
                    if rec.key == OPTIMIZER_KEY:
                        moved[name][f"memory_{rec.op}"] += rec.nbytes
                if name == "pause":
                    torch.cuda.synchronize()
                    free_paused, _ = torch.cuda.mem_get_info()
            torch.cuda.synchronize()
            marks["end"] = time.perf_counter()
            opt_exact = digest_tensors(driver.optimizer_state()) == opt_before if check else None
            results.append(rs)
            cycles.append(
                {
                    "epoch": lc.epoch,
                    "verified": lc.verifies(lc.epoch),
                    "train_s": train_s,
                    "optimizer_state_exact": opt_exact,
                    "freed_in_paused_bytes": (free_paused or 0) - free_training,
                    "moved": moved,
                    "alloc_s": sum(rec.alloc_s for rec in host.log if rec.key in ("actor", OPTIMIZER_KEY)),
                    "offload_wall_s": marks["pause_done"] - marks["offload"],
                    "wake_wall_s": marks["sync_done"] - marks["rematerialize"],
                    "cycle_wall_s": marks["end"] - marks["offload"],
                    "transfers": [
                        {"key": r.key, "op": r.op, "bytes": r.nbytes, "s": r.seconds, "alloc_s": r.alloc_s,
                         "waited": r.waited, "GBps": r.gbps if r.waited else None}
                        for r in host.log[log_mark:]
                    ],
                    "memory_calls": timed.events[mem_mark:],
                }
            )
            print(f"[{strategy}] cycle {c + 1}: " + " ".join(f"{n}={rs[n].duration_s * 1e3:.0f}ms" for n in CYCLE)
                  + f" opt_exact={opt_exact}", flush=True)
        lc.close()
        events = trace_events(trace_dir / "rank-0.jsonl")
        waits = verified_waits(trace_dir / "rank-0.jsonl")
        for cyc, rs in zip(cycles, results):
            cyc["verify_wait_s"] = waits.get(cyc["epoch"], 0.0)
            mv = cyc["moved"]
            cyc["transitions"] = {
                n: transition_row(r, events.get((r.epoch, n), 0), mv[n]["memory_save"] + mv[n]["memory_load"], limits)
                for n, r in rs.items()
            }
            # What crosses PCIe: every save (D2H) in the offload, every load (H2D) in the wake.
            cyc["crossed_d2h"] = {n: mv[n]["save"] for n in CYCLE}
            cyc["crossed_h2d"] = {n: mv[n]["load"] for n in CYCLE}
            cyc["offload"] = phase(cyc, OFFLOAD, "crossed_d2h", limits["pinned"]["d2h_GBps"], cyc["offload_wall_s"])
            cyc["wake"] = phase(cyc, WAKE, "crossed_h2d", limits["pinned"]["h2d_GBps"], cyc["wake_wall_s"])
            cyc.update(verification_share(cyc))
        out["strategies"][strategy] = {
            "cycles": cycles,
            "all_exact": all(c["optimizer_state_exact"] in (True, None) for c in cycles),
            "host_bytes": {
                "data": driver.host_bytes(),
                "optimizer_state": host.host_bytes(OPTIMIZER_KEY),
                "actor": host.host_bytes("actor"),
                "reserved": host.reserved_bytes(),
                "pinned": host.pinned_bytes(),
                "buffer_allocations": host.allocations,
            },
            "state": lc.state.value,
        }
    tensors = dict(driver.tensors())
    out["verification"] = verification_bench(tensors, threads=default_threads(), sync=torch.cuda.synchronize)
    opt = driver.optimizer_state()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    digest_tensors(opt)
    s = time.perf_counter() - t0
    nbytes = sum(t.numel() for t in opt.values())
    out["verification_optimizer_state"] = {"bytes": nbytes, "tensors": len(opt), "s": s, "GBps": nbytes / s / 1e9}
    out["verification"]["staging_pinned_bytes"] = StagingRing.for_device(torch.device("cuda", 0)).pinned_bytes
    out["wake_load"] = wake_load_limit(saver, host, opt)
    dist.destroy_process_group()
    return out


def wake_load_limit(saver: Any, host: Any, state: Mapping[str, Any], repeats: int = 2) -> dict[str, Any]:
    """The H2D limit that applies to a wake: the optimizer state's load alone, right after the
    three trainer tags are mapped again, and the same load 60 ms after the mapping.

    On an H200 the driver's own work on freshly mapped memory slows copy-engine
    H2D for about 50 ms (``benchmarks/gpu_copy_paths.py``); a wake cannot wait
    that out, so this is the rate its data path can reach. Run last: the
    param and grad buffers come back with undefined contents.
    """
    import torch

    from miles_fsm.drivers.megatron.driver import OPTIMIZER_KEY
    from miles_fsm.states import TRAINER_TAGS

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.cuda.synchronize()
    host.save(OPTIMIZER_KEY, state)
    out: dict[str, Any] = {"bytes": nbytes, "tags": list(TRAINER_TAGS)}
    for label, idle_s in (("just_mapped", 0.0), ("mapped_60ms_before", 0.06)):
        runs = []
        for _ in range(repeats):
            for tag in TRAINER_TAGS:
                saver.pause(tag)
            for tag in TRAINER_TAGS:
                saver.resume(tag)
            time.sleep(idle_s)
            t0 = time.perf_counter()
            host.load(OPTIMIZER_KEY, state)
            runs.append(time.perf_counter() - t0)
        out[label] = {"runs_s": runs, "GBps": nbytes / min(runs) / 1e9}
    return out

