"""What a transition will touch, described from rank-uniform facts.

A plan is hashed into a fingerprint that the guard compares across ranks. It
must be built only from facts every rank shares (names, shapes, dtypes,
bucket layout), never from per-rank pause state: the seed's 600 s hang came
from exactly that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Collective", "Intent", "TensorSet", "TensorSpec"]


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True, order=True)
class TensorSpec:
    """Name, shape and dtype of one tensor a transition moves."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.name}{list(self.shape)}:{self.dtype}"


@dataclass(frozen=True, slots=True)
class TensorSet:
    """A sorted, fingerprinted set of tensor specs."""

    specs: tuple[TensorSpec, ...]
    digest: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        specs = tuple(sorted(self.specs))
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "digest", _digest(";".join(map(str, specs))))

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, torch.Tensor]]) -> TensorSet:
        """The spec set of named tensors."""
        return cls(
            tuple(
                TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                for name, t in tensors
            )
        )

    @property
    def names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.specs)

    def __len__(self) -> int:
        return len(self.specs)



@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a step will issue: what, on which group, how big."""

    op: str
    group: str
    dtype: str
    numel: int

    def __str__(self) -> str:
        return f"{self.op}@{self.group}[{self.numel}:{self.dtype}]"


@dataclass(frozen=True, slots=True)
class Intent:
    """What one rank is about to do: the thing every rank must agree on."""

    epoch: int
    trigger: str
    source: str
    dest: str
    strategy: str
    collectives: tuple[Collective, ...]
    tensors: TensorSet

    key: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # The guard reads the key once per transition; hash here, once.
        text = "|".join(
            (
                str(self.epoch),
                self.trigger,
                self.source,
                self.dest,
                self.strategy,
                _digest(";".join(map(str, self.collectives))),
                self.tensors.digest,
            )
        )
        # 62 bits, so that both k and -k fit in the guard's int64 all-reduce.
        key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2
        object.__setattr__(self, "key", key)

    def fields(self) -> tuple[tuple[str, str], ...]:
        """The compared fields, in the order a divergence report names them."""
        return (
            ("epoch", str(self.epoch)),
            ("trigger", self.trigger),
            ("source state", self.source),
            ("destination state", self.dest),
            ("strategy", self.strategy),
            # The tensor set first: a tensor-set difference is the usual root
            # cause of a collective-plan difference, and its report names tensors.
            ("tensor set", f"{len(self.tensors)} tensors #{self.tensors.digest[:12]}"),
            ("collective plan", ", ".join(map(str, self.collectives)) or "(none)"),
        )
