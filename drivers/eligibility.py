"""Can rematerialize rebuild this model? The params outside its param buffers, and what to do about each.

Rematerialize keeps no host copy of the bf16 params: it rebuilds them from
the fp32 master weights (cast, then all-gather), and the optimizer holds
master weights only for what sits in a param buffer. Any other param must be
among the *extras* (it then keeps a host copy), or the model is refused when
the driver is built. The seed's known case is a frozen ``nn.Parameter``:
megatron's DDP gives it no buffer.

``rematerialize_eligibility`` decides it for any ``nn.Module`` (or any
named params), from structure alone, and says per param why it is outside
and what would fix it. An extra that names no param is reported with the
names it was probably meant to be (``difflib``), since a misspelt extra is
the usual reason a param someone meant to keep is refused.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    >>> m[1].weight.requires_grad_(False)  # doctest: +ELLIPSIS
    Parameter...
    >>> e = rematerialize_eligibility(m, in_buffers={id(m[0].weight), id(m[0].bias)}, extras=["1.bais"])
    >>> e.names
    ('1.weight', '1.bias')
    >>> e.unknown_extras[0].close
    ('1.bias',)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

import torch

from miles_fsm.drivers.errors import IneligibleModelError

__all__ = ["Eligibility", "Outside", "UnknownExtra", "rematerialize_eligibility"]

#: Which params sit in a param buffer: a predicate, or the ``id()``s of those params.
InBuffers = Callable[[torch.Tensor], bool] | Set[int]

_FROZEN = "frozen (requires_grad=False): DDP skips it; unfreeze it, put it among the extras, or use the backup strategy"
_UNREGISTERED = (
    "not registered in a DDP param buffer (buffers + expert_parallel_buffers; a param added after DDP was "
    "built is the usual cause): build DDP over the finished model, put it among the extras, or use the "
    "backup strategy"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outside:
    """One param that no param buffer holds and no extra names."""

    name: str
    frozen: bool
    #: What to do about it, in words (``IneligibleModelError`` shows it).
    suggestion: str


@dataclass(frozen=True, kw_only=True, slots=True)
class UnknownExtra:
    """An extra that names no param of the model, with the param names closest to it."""

    name: str
    close: tuple[str, ...]

    @property
    def hint(self) -> str:
        if not self.close:
            return f"{self.name!r} names no param of the model"
        return f"{self.name!r} names no param of the model; did you mean {' or '.join(map(repr, self.close))}?"


@dataclass(frozen=True, kw_only=True, slots=True)
class Eligibility:
    """What ``rematerialize_eligibility`` found; eligible when no param is outside."""

    outside: tuple[Outside, ...]
    unknown_extras: tuple[UnknownExtra, ...]

    @property
    def eligible(self) -> bool:
        return not self.outside

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the params outside, in the module's order."""
        return tuple(o.name for o in self.outside)

    @property
    def reason(self) -> str:
        """One line for all of them: frozen ones are the known case, and said so."""
        if all(o.frozen for o in self.outside):
            return "frozen (requires_grad=False), so DDP gave them no param buffer"
        return "not in any DDP param buffer (buffers + expert_parallel_buffers)"

    def raise_if_ineligible(self) -> None:
        """Raise ``IneligibleModelError`` naming every param outside, each with its suggestion."""
        if self.outside:
            raise IneligibleModelError(self.names, self.reason, [o.suggestion for o in self.outside])


def _member_of(ids: Set[int]) -> Callable[[torch.Tensor], bool]:
    return lambda p: id(p) in ids


def rematerialize_eligibility(
    module: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    in_buffers: InBuffers,
    extras: Iterable[str] = (),
) -> Eligibility:
    """The params of ``module`` that are in no param buffer and not among ``extras``, each with a hint.

    ``module`` is an ``nn.Module`` (its ``named_parameters()``, shared params
    once) or the named params themselves. ``in_buffers`` says which params a
    buffer holds: a predicate, or a set of ``id(param)``. Reads structure
    only (names, ``requires_grad``, identity), never tensor contents, so
    every rank with the same model gets the same answer.
    """
    named = list(module.named_parameters() if isinstance(module, torch.nn.Module) else module)
    inside = _member_of(in_buffers) if isinstance(in_buffers, Set) else in_buffers
    wanted = set(extras)
    outside = [(name, p) for name, p in named if name not in wanted and not inside(p)]
    names = [n for n, _ in named]
    out_names = [n for n, _ in outside]
    # A misnamed extra was most likely meant for a param that is now refused; look there first.
    unknown = tuple(
        UnknownExtra(name=e, close=tuple(_close(e, out_names) or _close(e, names))) for e in sorted(wanted - set(names))
    )
    found = []
    for name, p in outside:
        frozen = not p.requires_grad
        suggestion = _FROZEN if frozen else _UNREGISTERED
        meant = [u.name for u in unknown if name in u.close]
        if meant:
            suggestion += f"; the extras name {' and '.join(map(repr, meant))}, which no param has: was this one meant?"
        found.append(Outside(name=name, frozen=frozen, suggestion=suggestion))
    return Eligibility(outside=tuple(found), unknown_extras=unknown)


def _close(name: str, candidates: list[str]) -> list[str]:
    """Candidates ``name`` probably meant: a dotted suffix match first (a prefix left off), then close spellings."""
    suffix = [c for c in candidates if c.endswith("." + name)]
    return suffix[:3] or difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
