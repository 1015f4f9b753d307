"""One push of weights to every engine: the tensor path bucket by bucket, the broadcast path, and where it is.

``UpdateState`` records the engine and step a push is at, so that a failure
names them and the driver ends the sessions the push opened. The broadcast
path runs every engine's request and the trainer's side of a private NCCL
(or gloo) group concurrently, built the way SGLang builds its side; that
machinery is why the push is apart from the driver, which owns the order of
the steps around it (pause, sessions, flush, versions, checksums).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from miles_fsm.drivers.sglang.config import DistributedConfig, SGLangConfig
from miles_fsm.drivers.sglang.protocol import SGLangTransport

if TYPE_CHECKING:
    import torch
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["UpdateState", "push_distributed", "push_tensors", "set_versions", "wait_all"]

#: Buckets of named tensors, in push order.
Parts = Sequence[Sequence[tuple[str, "torch.Tensor"]]]


class UpdateState:
    """Where an update is: the engine and step now running, and the sessions it opened."""

    __slots__ = ("engine", "op", "opened")

    def __init__(self) -> None:
        self.engine: SGLangTransport | None = None
        self.op = "start"
        self.opened: list[SGLangTransport] = []

    def at(self, engine: SGLangTransport | None, op: str) -> None:
        self.engine = engine
        self.op = op



def push_tensors(
    transports: Sequence[SGLangTransport], config: SGLangConfig, state: UpdateState, parts: Parts, version: str
) -> None:
    """Each bucket to every engine in turn; the last one carries the version."""
    for i, bucket in enumerate(parts):
        last = i == len(parts) - 1
        for t in transports:
            state.at(t, f"update_weights_from_tensor (bucket {i + 1}/{len(parts)})")
            t.update_from_tensor(
                bucket,
                tp_size=config.tp_size,
                load_format=config.load_format,
                # Never flush inside an update: a flush refused there fails
                # the update itself. One /flush_cache after the session
                # fails on its own, with its own error.
                flush_cache=False,
                weight_version=version if last and t.sets_version else None,
            )
    if not parts:
        set_versions(transports, state, version)


def set_versions(transports: Sequence[SGLangTransport], state: UpdateState, version: str) -> None:
    for t in transports:
        if t.sets_version:
            state.at(t, "update_weight_version")
            t.set_version(version)


def push_distributed(
    transports: Sequence[SGLangTransport],
    config: SGLangConfig,
    state: UpdateState,
    parts: Parts,
    version: str,
    *,
    group_name: str,
) -> None:
    """Each bucket broadcast from the trainer (rank 0) to every engine, in a private group named ``group_name``."""
    import torch.distributed as dist

    cfg = config.distributed
    tp = config.tp_size
    port = cfg.master_port or _free_port(cfg.master_address)
    world = 1 + tp * len(transports)
    name = group_name
    pool = ThreadPoolExecutor(max_workers=len(transports) + 1, thread_name_prefix="sglang-push")
    clean = False
    try:
        joins: dict[SGLangTransport | None, Future[Any]] = {
            t: pool.submit(
                t.init_group,
                master_address=cfg.master_address,
                master_port=port,
                rank_offset=1 + i * tp,
                world_size=world,
                group_name=name,
                backend=cfg.backend,
            )
            for i, t in enumerate(transports)
        }
        joins[None] = pool.submit(_trainer_group, cfg, name, port, world)
        wait_all(state, "init_weights_update_group", joins)
        group = joins[None].result()
        try:
            for i, bucket in enumerate(parts):
                last = i == len(parts) - 1
                requests: dict[SGLangTransport | None, Future[Any]] = {
                    t: pool.submit(
                        t.update_from_distributed,
                        names=[n for n, _ in bucket],
                        dtypes=[str(x.dtype).removeprefix("torch.") for _, x in bucket],
                        shapes=[list(x.shape) for _, x in bucket],
                        group_name=name,
                        flush_cache=False,
                        load_format=config.load_format,
                        weight_version=version if last and t.sets_version else None,
                    )
                    for t in transports
                }
                requests[None] = pool.submit(_broadcast, bucket, group)
                wait_all(state, f"update_weights_from_distributed (bucket {i + 1}/{len(parts)})", requests)
            if not parts:
                set_versions(transports, state, version)
        finally:
            dist.destroy_process_group(group)
        destroys: dict[SGLangTransport | None, Future[Any]] = {
            t: pool.submit(t.destroy_group, name) for t in transports
        }
        wait_all(state, "destroy_weights_update_group", destroys)
        clean = True
    finally:
        # After a failure some threads may still wait in a rendezvous or a
        # broadcast that will never complete; they end at the group's
        # timeout, and must not hold the error back until then.
        pool.shutdown(wait=clean, cancel_futures=True)


def wait_all(state: UpdateState, op: str, futures: Mapping[SGLangTransport | None, Future[Any]]) -> None:
    """Wait until all succeed or one fails; a failure is raised at once, naming its engine.

    An engine that refused a request never joins the collective, so its
    error is the news, not the trainer side's timeout that would follow.
    """
    pending = set(futures.values())
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for t, fut in futures.items():
            error = fut.exception() if fut in done else None
            if error is not None:
                state.at(t, op if t is not None else f"{op} (trainer side)")
                raise error


def _broadcast(bucket: Sequence[tuple[str, torch.Tensor]], group: Any) -> None:
    import torch.distributed as dist

    for _, x in bucket:
        dist.broadcast(x.detach().contiguous(), src=0, group=group)


def _trainer_group(cfg: DistributedConfig, name: str, port: int, world: int) -> Any:
    """Rank 0 of the broadcast group, built the way SGLang builds its side.

    SGLang's ``init_custom_process_group``: a TCP rendezvous, a ``PrefixStore``
    named after the group, then ``_new_process_group_helper`` (private torch
    API, used the same way by SGLang, OpenRLHF and slime), so the store keys of
    both sides match.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=cfg.timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{cfg.master_address}:{port}", 0, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(cfg.backend), store, group_name=cast("GroupName", name), timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
