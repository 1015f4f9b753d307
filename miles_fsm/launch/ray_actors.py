"""Run a rank function on N Ray actors, as RL frameworks (miles, slime, verl, OpenRLHF) run trainer ranks.

The controller (this process) hosts the TCPStore, as the local launcher
does, so the store outlives any actor that dies and the survivors can still
name it. Each actor joins one gloo process group and runs the function; its
exception comes back through Ray as itself (miles-fsm errors pickle with their
message and fields), kept whole in ``RayOutcome.exception`` beside the flattened
``RankError``; one that does not pickle comes back as a ``RankRaisedError``
with its type name, message and traceback text, and never costs the other
ranks' outcomes. Every exit path kills the actors that are still alive.

Ray is an optional dependency: ``pip install ray``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from miles_fsm.errors import crossable
from miles_fsm.launch.local import RankContext, RankOutcome, flatten_error

__all__ = ["RayOutcome", "run_ranks_ray"]


@dataclass(frozen=True, slots=True)
class RayOutcome(RankOutcome):
    """A rank's outcome, plus the exception it raised, as Ray delivered it to the controller."""

    exception: BaseException | None = None


class _Rank:
    """One trainer rank as a Ray actor."""

    def run(self, fn: Callable[[RankContext], Any], rank: int, world: int, addr: str, port: int,
            kwargs: Mapping[str, Any], pg_timeout_s: float) -> Any:  # fmt: skip
        import torch.distributed as dist

        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore(addr, port, world + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            return fn(RankContext(rank=rank, world=world, kwargs=kwargs))
        except BaseException as exc:
            sent = crossable(exc, rank=rank)
            if sent is exc:
                raise
            # Ray could not send it, and would lose its type: the stand-in carries its name, message and traceback.
            raise sent from None
        finally:
            dist.destroy_process_group()


def run_ranks_ray(
    fn: Callable[[RankContext], Any],
    world: int,
    *,
    timeout_s: float,
    kwargs: Mapping[str, Any] | None = None,
    pg_timeout_s: float | None = None,
    linger_s: float | None = None,
) -> list[RayOutcome]:
    """Run ``fn`` on ``world`` Ray actors; one outcome per rank, in rank order.

    Starts a local Ray runtime if none is running (and stops it afterwards).
    ``timeout_s`` bounds the whole run; once a rank has failed the others
    get ``linger_s`` to report their own errors, then every actor still
    alive is killed and reported with no result.
    """
    try:
        import ray
    except ImportError as exc:
        from miles_fsm.errors import ConfigError

        raise ConfigError(["the Ray launcher needs ray: pip install ray"], "run_ranks_ray") from exc
    import torch.distributed as dist

    started_ray = not ray.is_initialized()
    if started_ray:
        # The ranks' own threads do the work; Ray's scheduler only has to place them.
        ray.init(num_cpus=world, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_import_path())}})  # fmt: skip
    addr = socket.gethostbyname(socket.gethostname()) if not started_ray else "127.0.0.1"
    store = dist.TCPStore(addr, 0, world + 1, is_master=True, wait_for_workers=False)
    actor_cls = ray.remote(num_cpus=1, max_restarts=0)(_Rank)
    # Any: ray types a started actor as ``ActorHandle[T] | type[T]``, through which no method call type-checks.
    actors: list[Any] = [actor_cls.options(name=f"miles-fsm-rank-{r}-{os.getpid()}").remote() for r in range(world)]
    t0 = time.monotonic()
    refs = {
        a.run.remote(fn, r, world, addr, store.port, dict(kwargs or {}), pg_timeout_s or timeout_s): r
        for r, a in enumerate(actors)
    }
    outcomes: dict[int, RayOutcome] = {}
    deadline = t0 + timeout_s
    try:
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            for ref in done:
                rank = refs[ref]
                outcomes[rank] = _outcome(ray, ref, rank, time.monotonic() - t0)
                if linger_s is not None and not outcomes[rank].ok:
                    deadline = min(deadline, time.monotonic() + linger_s)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if started_ray:
            ray.shutdown()
    return [outcomes.get(r, RayOutcome(r, None, killed=True)) for r in range(world)]


def _outcome(ray: Any, ref: Any, rank: int, elapsed: float) -> RayOutcome:
    try:
        result = ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        exc = err.cause if isinstance(err.cause, BaseException) else err
        return RayOutcome(rank, 1, None, flatten_error(exc), elapsed, exception=exc)
    except ray.exceptions.RayActorError as err:  # the actor's process died (a crash, a kill)
        return RayOutcome(rank, None, None, None, elapsed, exception=err)
    except ray.exceptions.RayError as err:  # any other way Ray failed to deliver it: this rank's, not every rank's
        return RayOutcome(rank, 1, None, flatten_error(err), elapsed, exception=err)
    return RayOutcome(rank, 0, result, None, elapsed)


def _import_path() -> list[str]:
    # Actors must import the rank function by name, as the local launcher's children do.
    import sys

    return [p for p in sys.path if p]
