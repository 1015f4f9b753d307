"""megatron-core's DDP param and grad buffers: routing them into memory tags, and finding them.

``ddp_buffers_in_tags`` places each ``_ParamAndGradBuffer``'s ``param_data``
under ``param_buffer`` and ``grad_data`` under ``grad_buffer`` while the
chunks are built, so a memory saver can pause them by tag. It reaches into a
private megatron class for the length of one block, which is why it lives
apart from the driver: the driver only reads the buffers afterwards
(``chunk_buffers``, ``buffer_device``, ``buffer_storages``), whoever
allocated them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from miles_fsm.drivers.errors import BufferRoutingError

__all__ = ["Allocator", "buffer_device", "buffer_storages", "chunk_buffers", "ddp_buffers_in_tags"]


class Allocator(Protocol):
    """The part of a memory saver that allocates a flat tensor under a tag."""

    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor: ...


class _BufferRouter(TorchFunctionMode):
    """Inside one ``_ParamAndGradBuffer.__init__``: the buffer allocations go to their tags.

    megatron allocates ``param_data`` (distributed optimizer only) and then
    ``grad_data`` with ``torch.zeros(numel, dtype=..., device=...,
    requires_grad=False)``; those two calls, in that order, are served by the
    saver instead. Anything else passes through.
    """

    def __init__(self, saver: Allocator, tags: list[str]) -> None:
        super().__init__()
        self._saver = saver
        self._pending = list(tags)
        self.routed: dict[str, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and self._pending and kwargs.get("requires_grad") is False and len(args) == 1:
            tag = self._pending.pop(0)
            numel = int(args[0])
            tensor = self._saver.empty(tag, numel, kwargs.get("dtype") or torch.get_default_dtype(), backup=False)
            self.routed[tag] = tensor
            return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def ddp_buffers_in_tags(saver: Allocator) -> Iterator[None]:
    """Build DDP chunks inside this: their param and grad buffers are allocated by ``saver``.

    Each ``_ParamAndGradBuffer`` gets ``param_data`` under ``param_buffer``
    and ``grad_data`` under ``grad_buffer``, neither with a region backup
    (the driver brings params back itself; grads are zeroed before use).
    The wrapper is installed only for the duration of the block, and it
    checks after each buffer that megatron really kept the routed tensors,
    raising ``BufferRoutingError`` if a megatron-core version allocates
    differently.
    """
    with _quiet_megatron():
        from megatron.core.distributed import param_and_grad_buffer as pgb

    cls = pgb._ParamAndGradBuffer
    original = cls.__init__
    signature = inspect.signature(original)

    def routed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        distopt = bool(bound.arguments["ddp_config"].use_distributed_optimizer)
        tags = (["param_buffer"] if distopt else []) + ["grad_buffer"]
        router = _BufferRouter(saver, tags)
        with router:
            original(self, *args, **kwargs)
        _check_routed(self, router.routed, tags)

    cls.__init__ = routed_init
    try:
        yield
    finally:
        cls.__init__ = original


def _check_routed(buffer: Any, routed: Mapping[str, torch.Tensor], tags: Sequence[str]) -> None:
    for tag, attr in (("param_buffer", "param_data"), ("grad_buffer", "grad_data")):
        if tag not in tags:
            continue
        mine = routed.get(tag)
        theirs = getattr(buffer, attr, None)
        if mine is None or theirs is None or theirs.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr():
            raise BufferRoutingError(
                buffer=attr, expected=tags, detail=f"its {attr} is not the tensor allocated under {tag!r}"
            )


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    # megatron warns at import that Apex/TransformerEngine are absent; that is expected here.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine).*")
        yield


def chunk_buffers(chunk: Any) -> list[Any]:
    """A DDP chunk's ``_ParamAndGradBuffer``s: the dense ones, then the expert-parallel ones."""
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def buffer_device(chunks: Sequence[Any]) -> torch.device:
    """Where the chunks' DDP buffers live (the first param's device when there are none)."""
    for chunk in chunks:
        for buf in chunk_buffers(chunk):
            data = getattr(buf, "param_data", None)
            if data is None:
                data = buf.grad_data
            return data.device
    return next(p.device for chunk in chunks for p in chunk.module.parameters())


def buffer_storages(chunks: Sequence[Any]) -> set[int]:
    """The storage addresses of every DDP param and grad buffer.

    Read afresh on each call: a saver may give a resumed buffer a new address.
    """
    out = set()
    for chunk in chunks:
        for buf in chunk_buffers(chunk):
            for attr in ("param_data", "grad_data"):
                data = getattr(buf, attr, None)
                if data is not None:
                    out.add(data.untyped_storage().data_ptr())
    return out


def tags_holding_params(chunks: Sequence[Any], named_params: Iterable[tuple[str, Any]],
                        named_buffers: Iterable[tuple[str, torch.Tensor]]) -> frozenset[str] | None:  # fmt: skip
    """The memory tags that hold every param and buffer, when known: ``param_buffer`` when each
    one is a view of a DDP buffer's ``param_data`` (routed there under the distributed
    optimizer), else None (unknown: a pause of any tag may release one)."""
    bufs = [b for chunk in chunks for b in chunk_buffers(chunk)]
    if any(True for _ in named_buffers) or any(getattr(b, "param_data", None) is None for b in bufs):
        return None
    held = {id(p) for b in bufs for p in b.params}
    return frozenset({"param_buffer"}) if all(id(p) in held for _, p in named_params) else None
