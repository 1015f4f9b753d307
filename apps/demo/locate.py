"""How a failed rank names the rank to blame, from what it can see while the run is live.

Evidence, in order: tensors that failed verification map to the ranks whose
master shard they come from; /proc says which peers' processes are gone
(each rank publishes its pid in the store for this); the store says which
peers published a failure. A dead peer outranks a failed one: a rank that
dies takes its peers' collectives down with it, and those peers publish
failures of their own a moment later.
"""

from __future__ import annotations

import os
import time
from typing import Any

from miles_fsm.apps.errors import FaultLocatedError

__all__ = ["locate", "publish_pid"]

_PID_KEY = "miles_fsm/demo/pid/"
#: How long a failed rank looks for the peer to blame before giving up
#: (part of the time budget in ``DemoConfig.pg_timeout_s``).
_LOCATE_GRACE_S = 1.0
#: How long a failed peer alone waits for a dead one to show in /proc.
_DEAD_GRACE_S = 0.3


def publish_pid(rank: int) -> None:
    """Tell the peers this rank's pid, so that they can tell when its process is gone."""
    import torch.distributed as dist

    dist.distributed_c10d._get_default_store().set(f"{_PID_KEY}{rank}", str(os.getpid()))


def locate(exc: BaseException, *, rank: int, world: int, guard: Any, trainer: Any) -> FaultLocatedError | None:
    """A ``FaultLocatedError`` naming the culprit, when ``exc`` does not name one itself."""
    from miles_fsm.errors import transport_failure
    from miles_fsm.states.errors import VerificationError

    if getattr(exc, "culprits", None) or getattr(exc, "missing", None):
        return None  # the guard already named it
    text = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
    cause = f"{type(exc).__name__}: {text}"
    if isinstance(exc, VerificationError) and exc.mismatched:
        owners = sorted(trainer.owners(exc.mismatched))
        return FaultLocatedError(
            rank=rank,
            culprits=owners,
            evidence=f"the mismatched tensors ({', '.join(exc.mismatched[:4])}) come from the master-weight "
            f"shard or state of rank(s) {', '.join(map(str, owners))}",
            cause=cause,
        )
    if world == 1:
        return None
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    # A peer's sockets close before its process is gone from /proc: give it a moment.
    # A timed-out collective means nobody died (a lost peer ends it at once):
    # the peers that time out with us publish their failures within moments,
    # and the rank that stays silent is the one that stopped answering.
    timed_out = transport_failure(exc) == "timeout"
    start = time.monotonic()
    while True:
        failed = {r: s for r, s in guard.failures().items() if r != rank}
        # A peer that published its failure and then exited reported; one gone without a word did not.
        dead = [r for r in range(world) if r != rank and r not in failed and not _alive(store, r)]
        if dead:
            evidence = "; ".join(f"rank {r}: process gone without reporting" for r in dead)
            return FaultLocatedError(rank=rank, culprits=dead, evidence=evidence, cause=cause)
        waited = time.monotonic() - start
        if waited >= _LOCATE_GRACE_S or (failed and not timed_out and waited >= _DEAD_GRACE_S):
            break
        time.sleep(0.05)
    silent = [r for r in range(world) if r != rank and r not in failed]
    if timed_out and silent:
        return FaultLocatedError(
            rank=rank,
            culprits=silent,
            evidence=f"a collective timed out and rank(s) {', '.join(map(str, silent))} published no failure: "
            "alive but not answering (hung inside the collective, or stopped)",
            cause=cause,
        )
    if not failed:
        return None
    return FaultLocatedError(
        rank=rank, culprits=sorted(failed), evidence="; ".join(str(s) for s in failed.values()), cause=cause
    )


def _alive(store: Any, rank: int) -> bool:
    try:
        pid = int(store.get(f"{_PID_KEY}{rank}"))
    except RuntimeError:  # the store is the parent's; if it is gone we cannot tell
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
