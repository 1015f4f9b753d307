"""A plain torch.distributed job (no miles-fsm) that hangs as miles PR #2223 describes, and dumps its recorder.

Four gloo ranks run a few steps of an all-gather of the params and a
reduce-scatter of the grads on their data-parallel group; at step 3 rank 3
takes the wrong branch and reduce-scatters while its peers all-gather. The
collective times out (2 s), and each rank writes its Flight Recorder to
``OUT/nccl_trace_rank_<r>``, as ``TORCH_NCCL_DUMP_ON_TIMEOUT`` does on NCCL:

    python examples/fr_hang.py /tmp/frhang
    miles-fsm replay --flight-recorder /tmp/frhang
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, BAD_STEP, BAD_RANK = 4, 3, 3


def rank_main(rank: int, out: str, port: int) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # read when the first process group is made
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    dp = dist.new_group(backend="gloo", group_desc="dp", timeout=timedelta(seconds=2))
    params, grads = torch.ones(8), torch.ones(8 * WORLD)
    try:
        for step in range(1, 5):
            dist.all_reduce(torch.ones(1))  # the loss, on the default group
            if step == BAD_STEP and rank == BAD_RANK:
                dist.reduce_scatter_tensor(torch.empty(8), grads, group=dp)
            else:
                dist.all_gather_into_tensor(torch.empty(8 * WORLD), params, group=dp)
            dist.reduce_scatter_tensor(torch.empty(8), grads, group=dp)
    except RuntimeError as exc:  # the timeout: dump, as the watchdog would
        with open(os.path.join(out, f"nccl_trace_rank_{rank}"), "wb") as f:
            f.write(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
        print(f"rank {rank}: {type(exc).__name__} ({'timed out' if 'Timed out' in str(exc) else 'failed'}); dumped to {out}", flush=True)
    os._exit(0)  # the job is hung: leave without a barrier


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else "frhang"
    os.makedirs(folder, exist_ok=True)
    mp.start_processes(rank_main, args=(folder, 29612), nprocs=WORLD, start_method="spawn")
