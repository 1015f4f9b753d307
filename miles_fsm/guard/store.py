"""The guard's store: which one, and where in it a guard keeps its keys.

Not every rank builds every guard: a guard over a subgroup is built by its
members only. A namespace numbered by a process-wide counter would then differ
between the members of one group, and they would look for each other's keys in
vain. So the namespace is what every member of the group shares: its global
ranks and the lifecycle's name, numbered only among guards over those same
ranks and name (actor and ref over one group, or two guards of one lifecycle),
which every member builds in the same order.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from miles_fsm.errors import ConfigError

__all__ = ["default_store", "env_world_size", "group_namespace", "stable_hash"]

_SERIALS: dict[tuple[str, tuple[int, ...], str], Iterator[int]] = {}


def group_namespace(kind: str, members: tuple[int, ...], name: str | None) -> str:
    """The next namespace of ``kind`` ("guard", "roll") for the group of global ranks ``members``.

    Collective in effect: every member calls it once per guard over the group, in the same order.
    """
    label = name or "guard"
    serial = next(_SERIALS.setdefault((kind, members, label), itertools.count()))
    return f"miles_fsm/{kind}/{label}.{stable_hash(','.join(map(str, members))):x}.{serial}/"


def stable_hash(text: str) -> int:
    """63 bits of a stable hash (Python's ``hash()`` differs between processes)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def env_world_size() -> int:
    """The world size a launcher claims in the environment (1: none claims several ranks)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1  # not a launcher's variable; nothing claims several ranks


def default_store() -> Any:
    """The torch.distributed default store; ``ConfigError`` saying what to pass if it is not reachable."""
    # torch keeps the default store behind a private name; say what to do if it moves.
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            [f"the torch.distributed default store is not reachable ({type(exc).__name__}: {exc}); pass "
             "store= (a TCPStore, or the launcher's store) to Guard.from_group or Lifecycle"],
            "Guard",
        ) from exc
