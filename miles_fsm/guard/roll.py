"""The roll call before a guard is built: every rank of its group says it came, or is named."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from miles_fsm.errors import PeerNeverJoinedError
from miles_fsm.guard.store import group_namespace

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["roll_call"]

_POLL_S = 0.05


def roll_call(store: dist.Store, *, members: tuple[int, ...], rank: int, timeout_s: float, name: str | None = None) -> None:
    """Return once every rank of a group (``members``: its global ranks; ``rank``: this one's in it) has
    called it; else raise ``PeerNeverJoinedError`` naming, by group rank, those that never did, after
    ``timeout_s``. Collective over the group: each of its ranks calls it, in the same order.

    A guard's construction is collective (its gloo group); a rank that never
    builds it would leave the others in torch's own store wait, which names
    nobody. Each rank's key says it came; one ``check`` per poll reads them all.
    """
    ns = group_namespace("roll", members, name)
    keys = [f"{ns}{r}" for r in range(len(members))]
    store.set(keys[rank], "1")
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                raise PeerNeverJoinedError(missing=missing, timeout_s=timeout_s, name=name)
            return
        time.sleep(_POLL_S)
