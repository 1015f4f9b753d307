"""The Megatron optimizer's device state: one flat allocation, and the driver's host copy of it.

Two ideas about the same storages (fp32 master shards, Adam's moments,
scalars such as ``_scale_one``), apart from the trainer driver because
neither needs its lifecycle:

- ``coalesce_optimizer_state`` moves the state into ONE allocation once,
  before training, so pausing and resuming ``default`` costs one mapping
  instead of a thousand;
- ``OptimizerOffload`` names every storage the optimizer objects hold, as
  flat byte views, and under ``optimizer_offload="driver"`` saves them to
  the host when ``default`` pauses and loads them when it resumes, without a
  torch_memory_saver backup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

import torch

from miles_fsm.drivers.megatron.buffers import buffer_device, buffer_storages
from miles_fsm.drivers.pinned import HostCopies
from miles_fsm.errors import ConfigError

__all__ = ["OPTIMIZER_KEY", "OPTIMIZER_TAG", "OptimizerOffload", "coalesce_optimizer_state", "inner_optimizers"]

#: The host-copy key of the optimizer state (``optimizer_offload="driver"``).
OPTIMIZER_KEY = "optimizer_state"
#: The memory tag the optimizer state is allocated under.
OPTIMIZER_TAG = "default"
_GRAD_TAG = "grad_buffer"


def inner_optimizers(optimizer: Any) -> tuple[Any, ...]:
    """The ``DistributedOptimizer``s of a ``ChainedOptimizer``, or the optimizer itself."""
    return tuple(getattr(optimizer, "chained_optimizers", None) or (optimizer,))


def _shards_and_state(opt: Any, k: int, shard_attrs: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """One inner optimizer's fp32 shards and per-param state, named, in a fixed order."""
    for attr in shard_attrs:
        for g, group in enumerate(getattr(opt, attr, None) or ()):
            for i, t in enumerate(group):
                yield f"opt{k}.{attr}.{g}.{i}", t
    inner = getattr(opt, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                for key, value in sorted(inner.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                    yield f"opt{k}.state.{g}.{i}.{key}", value


def coalesce_optimizer_state(optimizer: Any, allocate: Callable[[int], torch.Tensor]) -> int:
    """Move the optimizer's device state into ONE flat allocation; returns its bytes.

    megatron's distributed optimizer keeps a separate tensor per param for
    the fp32 master shard and for each of Adam's moments: about a thousand
    allocations for a 1.6 B GPT. Under torch_memory_saver every one is a
    mapping to unmap on pause and map again on resume, which on an H200
    cost 30-50 ms per pause and per resume of ``default``. Here each such
    tensor (one that owns its whole storage; views are left alone) gets its
    bytes copied into a view of ``allocate(nbytes)`` (a uint8 tensor; call
    it inside the ``default`` region) and is re-pointed there with
    ``.data``, so every reference (param groups, state keys, megatron's
    shard lists) follows. Build the optimizer and its state *outside* the
    region, call this, then ``torch.cuda.empty_cache()``: the region then
    holds one allocation, paused and resumed in a millisecond, and copied
    as one stream of chunks.
    """
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    device: torch.device | None = None

    def consider(t: Any) -> None:
        nonlocal device
        if not isinstance(t, torch.Tensor) or t.dim() == 0 and not t.is_cuda:
            return
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
        if not whole or storage.data_ptr() in seen or storage.nbytes() == 0:
            return
        if device is None:
            device = t.device
        if t.device != device:
            return
        seen.add(storage.data_ptr())
        tensors.append(t)

    for k, opt in enumerate(inner_optimizers(optimizer)):
        for _, t in _shards_and_state(opt, k, ("shard_fp32_from_float16_groups",)):
            consider(t)
    align = 512
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    if not tensors:
        return 0
    flat = allocate(end)
    if flat.dtype != torch.uint8 or flat.numel() < end or flat.device != device:
        raise ConfigError([f"allocate({end}) must return a uint8 tensor of that many bytes on {device}"],
                          "coalesce_optimizer_state")
    with torch.no_grad():
        for t, start in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            view = flat[start : start + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
    return end


class OptimizerOffload:
    """The optimizer state of one ``MegatronTrainer``, and (``enabled``) its round trip through ``host``.

    The trainer calls ``before_pause``/``before_resume``/``after_resume``
    around every tag it pauses or resumes; they do nothing unless
    ``enabled`` (``optimizer_offload="driver"``). ``state()`` works either way.
    """

    def __init__(self, *, chunks: Sequence[Any], optimizer: Any, host: HostCopies, enabled: bool) -> None:
        self._chunks = tuple(chunks)
        self._optimizer = optimizer
        self._inner = inner_optimizers(optimizer)
        self._host = host
        self._enabled = enabled
        self._views: tuple[list[tuple[int, int]], dict[str, torch.Tensor], list[torch.Tensor]] | None = None
        #: The state's D2H was started by the pause of grad_buffer and not yet awaited.
        self._saving = False

    def before_pause(self, tag: str, paused: Set[str]) -> bool:
        """Save the state if pausing ``tag`` calls for it; True when ``tag`` is to be paused without a
        device synchronization (the save was only started, and the unmap need not wait for it)."""
        if not self._enabled:
            return False
        if tag == _GRAD_TAG and OPTIMIZER_TAG not in paused and not self._saving:
            # The offload pauses grad_buffer, then default. Start the optimizer
            # state's D2H first and unmap grad_buffer while it crosses PCIe: the
            # device is idle but for copies of other memory, so the unmap needs
            # no device synchronization (measured on H200: 2-3 ms, not waiting
            # for a 16 GiB copy in flight).
            _synchronize(buffer_device(self._chunks))
            self._host.save(OPTIMIZER_KEY, self.state(), wait=False)
            self._saving = True
            return True
        if tag == OPTIMIZER_TAG:
            if self._saving:
                self._host.synchronize()
                self._saving = False
            else:
                self._host.save(OPTIMIZER_KEY, self.state())
        return False

    def before_resume(self) -> None:
        if self._saving:
            # A resume before default was paused: that early save is stale from
            # here on (training can start again), so finish it and forget it.
            self._host.synchronize()
            self._saving = False

    def after_resume(self, tag: str) -> None:
        if self._enabled and tag == OPTIMIZER_TAG:
            # Queued, not awaited: the current stream waits for the loads, so the
            # cast and everything after it are ordered behind them, while the
            # host goes on with the transition's other steps.
            self._host.load(OPTIMIZER_KEY, self.state(), wait=False)

    def state(self) -> dict[str, torch.Tensor]:
        """Every storage the optimizer objects hold outside the DDP buffers, as flat byte tensors.

        Walked in a fixed order: per inner optimizer, the fp32 master shards,
        then each param's optimizer state (Adam's moments, a device step),
        then tensor attributes of the inner and chained optimizer objects
        (``_scale_one``, ``found_inf``). Views of one storage count once;
        storages inside a DDP param or grad buffer (the bf16 params, the
        main grads, fp32 params' shards) are left out: those tags are
        rebuilt, not restored. Only storages on the buffers' device count.
        """
        sources = self._sources()
        # The walk is cheap; building the byte views is not (~10 us each, a thousand
        # of them): reuse them while every source is the same tensor at the same address.
        key = [(id(t), t.data_ptr()) for _, t in sources]
        cached = self._views
        if cached is not None and cached[0] == key:
            return dict(cached[1])
        device = buffer_device(self._chunks)
        skip = buffer_storages(self._chunks)
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in sources:
            if t.device != device:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or ptr in skip or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            flat = torch.empty(0, dtype=torch.uint8, device=device)
            out[name] = flat.set_(storage, 0, (storage.nbytes(),), (1,))
        self._views = (key, out, [t for _, t in sources])  # the sources stay alive: ids stay unique
        return dict(out)

    def _sources(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the optimizer objects reference, named, in a fixed order."""
        named: list[tuple[str, Any]] = []
        for k, opt in enumerate(self._inner):
            named += _shards_and_state(opt, k, ("shard_fp32_from_float16_groups", "shard_fp32_groups"))
            named += ((f"opt{k}.{attr}", value) for attr, value in sorted(vars(opt).items()))
        named += ((f"chained.{attr}", value) for attr, value in sorted(vars(self._optimizer).items()))
        return [(name, t) for name, t in named if isinstance(t, torch.Tensor)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
