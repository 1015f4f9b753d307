"""The Megatron trainer driver: megatron-core DDP chunks and the distributed optimizer.

``MegatronTrainer`` implements ``TrainerDriver`` over the model chunks
(``DistributedDataParallel``) and the optimizer (a ``ChainedOptimizer`` of
``DistributedOptimizer``s, as ``get_megatron_optimizer`` returns) a trainer
already has. Two strategies bring the actor's bf16 params back after the
engine had the GPU:

- **rematerialize**: no host copy of the bf16 params. Each inner optimizer's
  ``_copy_main_params_to_model_params()`` writes this rank's fp32 master
  shard into its slice of the param buffer, then every chunk's
  ``start_param_sync(force_sync=True)`` all-gathers the rest. Only the
  *extras* keep a host copy: fp32 params (their master *is* the param buffer,
  which is paused without backup), module buffers (``expert_bias``), and any
  ``extra_params`` the config names.
- **backup**: a full host copy (pinned on CUDA) of every tensor, per tag.

Host copies live in persistent flat buffers (``drivers/pinned.py``), pinned
on CUDA and reused every cycle; copies are chunked over two streams.
With ``optimizer_offload="driver"`` the optimizer state (``default`` tag)
takes the same path: on pause the driver copies every device storage the
optimizer objects hold (fp32 master shards, Adam moments, scalars such as
``_scale_one``) into its pinned buffer and pauses the tag *without* a
torch_memory_saver backup; on resume it copies them back. Build the
optimizer under a ``default`` region without ``enable_cpu_backup`` then
(``MegatronDriverConfig.tag_memory`` says so), and put nothing else there
that must survive: only what the optimizer references comes back.

The non-actor tags (``ref``, ``teacher``, ``old_actor``, ``rollout_actor``)
always keep full host copies.

Whether rematerialize is safe is decided from the model's *structure* when
the driver is built: a param outside every DDP param buffer (a frozen
``nn.Parameter`` is the known case) and not among the extras cannot be
rebuilt, so construction raises ``IneligibleModelError`` naming it.

The collective plan (``collectives``) and the tensor set (``tensor_set``)
read only rank-uniform facts: bucket layout, names, shapes, dtypes. Neither
reads what is paused on this rank.

Memory goes through a ``MemorySaver`` (``drivers/cpu_memory.py`` on CPU,
torch_memory_saver on CUDA). ``ddp_buffers_in_tags`` places each DDP buffer's
``param_data`` under ``param_buffer`` and ``grad_data`` under
``grad_buffer`` while the chunks are built.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from miles_fsm.drivers.megatron_config import MegatronDriverConfig, megatron_facts
from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
from miles_fsm.states.protocols import StepReport
from miles_fsm.drivers.errors import BufferRoutingError, HostCopyMissingError, IneligibleModelError
from miles_fsm.errors import ConfigError, MemoryReleasedError
from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import Step, StepKind, Strategy

__all__ = [
    "ACTOR",
    "NON_ACTOR_TAGS",
    "OPTIMIZER_KEY",
    "MegatronTrainer",
    "PauseResume",
    "coalesce_optimizer_state",
    "ddp_buffers_in_tags",
]

ACTOR = "actor"
#: The host-copy key of the optimizer state (``optimizer_offload="driver"``).
OPTIMIZER_KEY = "optimizer_state"
#: The memory tag the optimizer state is allocated under.
_OPTIMIZER_TAG = "default"
_GRAD_TAG = "grad_buffer"
NON_ACTOR_TAGS = ("ref", "teacher", "old_actor", "rollout_actor")
_HALF = (torch.bfloat16, torch.float16)


class PauseResume(Protocol):
    """The part of a memory saver the driver calls during the lifecycle."""

    def pause(self, tag: str, *, synchronize: bool = True) -> None: ...

    def resume(self, tag: str) -> None: ...


class _Allocator(Protocol):
    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor: ...


# --------------------------------------------------------------------------- routing


class _BufferRouter(TorchFunctionMode):
    """Inside one ``_ParamAndGradBuffer.__init__``: the buffer allocations go to their tags.

    megatron allocates ``param_data`` (distributed optimizer only) and then
    ``grad_data`` with ``torch.zeros(numel, dtype=..., device=...,
    requires_grad=False)``; those two calls, in that order, are served by the
    saver instead. Anything else passes through.
    """

    def __init__(self, saver: _Allocator, tags: list[str]) -> None:
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
def ddp_buffers_in_tags(saver: _Allocator) -> Iterator[None]:
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

    for opt in getattr(optimizer, "chained_optimizers", None) or (optimizer,):
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or ():
            for t in group:
                consider(t)
        inner = getattr(opt, "optimizer", None)
        if inner is not None and hasattr(inner, "state"):
            for group in inner.param_groups:
                for p in group["params"]:
                    for _, value in sorted(inner.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                        consider(value)
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
        for t, start in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            view = flat[start : start + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
    return end


# --------------------------------------------------------------------------- driver


class MegatronTrainer:
    """``TrainerDriver`` over megatron-core DDP chunks and a (chained) distributed optimizer.

    Build it once the chunks and the optimizer exist, on every rank, with the
    same arguments; construction runs no collective.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[Any],
        optimizer: Any,
        config: MegatronDriverConfig | None = None,
        memory: PauseResume | None = None,
        convert: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
        host: HostCopies | None = None,
    ) -> None:
        if not chunks:
            raise ConfigError(["at least one DDP model chunk is needed"], "MegatronTrainer")
        self._chunks = tuple(chunks)
        self._optimizer = optimizer
        self._inner = tuple(getattr(optimizer, "chained_optimizers", None) or (optimizer,))
        self._config = config or MegatronDriverConfig.from_megatron(self._chunks, optimizer)
        self._memory = memory
        self._convert = convert
        # Shared between drivers when given (one set of pinned buffers per process).
        self._host = host if host is not None else HostCopies(config=PinnedConfig(pin=self._config.pin_memory))
        self._weight_tags: set[str] = set()
        self._optimizer_views: tuple[list[tuple[int, int]], dict[str, torch.Tensor], list[torch.Tensor]] | None = None
        self._paused: set[str] = set()
        #: The optimizer state's D2H was started by the pause of grad_buffer and not yet awaited.
        self._optimizer_saving = False
        self._check_megatron_agrees()
        if self.strategy is Strategy.REMATERIALIZE:
            self._check_eligible()
        self._extra_param_names = self._find_extra_params()

    # ------------------------------------------------------------- structure

    @property
    def config(self) -> MegatronDriverConfig:
        return self._config

    @property
    def strategy(self) -> Strategy:
        return self._config.effective_strategy

    @property
    def chunks(self) -> tuple[Any, ...]:
        return self._chunks

    @property
    def inner_optimizers(self) -> tuple[Any, ...]:
        return self._inner

    def _prefix(self, i: int) -> str:
        return f"chunk{i}." if len(self._chunks) > 1 else ""

    def _named_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for i, chunk in enumerate(self._chunks):
            for name, p in chunk.module.named_parameters():
                yield self._prefix(i) + name, p

    def _named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, chunk in enumerate(self._chunks):
            for name, b in chunk.module.named_buffers():
                yield self._prefix(i) + name, b

    def _ddp_buffers(self, chunk: Any) -> list[Any]:
        return list(chunk.buffers) + list(chunk.expert_parallel_buffers)

    def _in_buffers(self) -> set[int]:
        return {id(p) for chunk in self._chunks for buf in self._ddp_buffers(chunk) for p in buf.params}

    def _check_megatron_agrees(self) -> None:
        """The config must describe the objects it is given; every disagreement at once."""
        problems = []
        facts = megatron_facts(self._chunks, self._optimizer)
        for key, actual in facts.items():
            stated = getattr(self._config, key)
            if stated != actual:
                problems.append(f"config says {key}={stated}, but the megatron objects say {actual}")
        if self.strategy is Strategy.REMATERIALIZE:
            for i, chunk in enumerate(self._chunks):
                for j, buf in enumerate(self._ddp_buffers(chunk)):
                    if getattr(buf, "param_data", None) is None:
                        problems.append(f"chunk {i} buffer {j} has no param_data (is the distributed optimizer on?)")
            for k, opt in enumerate(self._inner):
                if not hasattr(opt, "_copy_main_params_to_model_params") or not hasattr(
                    opt, "shard_fp32_from_float16_groups"
                ):
                    problems.append(
                        f"inner optimizer {k} is a {type(opt).__name__}, not a DistributedOptimizer: "
                        "it holds no fp32 master shards to rematerialize from"
                    )
        known = {n for n, _ in self._named_params()}
        unknown = sorted(set(self._config.extra_params) - known)
        if unknown:
            problems.append(f"extra_params names params the model does not have: {', '.join(unknown)}")
        if problems:
            raise ConfigError(problems, "MegatronTrainer (config vs. megatron objects)")

    def _check_eligible(self) -> None:
        """Rematerialize rebuilds only what sits in a DDP param buffer; refuse anything else."""
        in_buffers = self._in_buffers()
        extras = set(self._config.extra_params)
        outside = [(n, p) for n, p in self._named_params() if id(p) not in in_buffers and n not in extras]
        if outside:
            frozen = [n for n, p in outside if not p.requires_grad]
            reason = (
                "frozen (requires_grad=False), so DDP gave them no param buffer"
                if len(frozen) == len(outside)
                else "not in any DDP param buffer (buffers + expert_parallel_buffers)"
            )
            raise IneligibleModelError([n for n, _ in outside], reason)

    def _find_extra_params(self) -> tuple[str, ...]:
        """Params rematerialize cannot rebuild: fp32 ones (their master is the param buffer itself),
        and the ones the config names. A structural, rank-uniform fact."""
        extras = set(self._config.extra_params)
        return tuple(n for n, p in self._named_params() if p.dtype not in _HALF or n in extras)

    # ------------------------------------------------------------ tensor views

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every param and buffer of the actor, live (verification hashes these)."""
        out = dict(self._named_params())
        out.update(self._named_buffers())
        return out

    def _extras(self) -> dict[str, torch.Tensor]:
        live = self.tensors()
        names = list(self._extra_param_names) + [n for n, _ in self._named_buffers()]
        return {n: live[n] for n in names}

    def tensor_set(self) -> TensorSet:
        """Names, shapes and dtypes of the params and buffers; never reads pause state."""
        return TensorSet.of(self.tensors().items())

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        """The param sync's all-gathers: one per bucket, from the bucket layout alone."""
        if step.kind is not StepKind.PARAM_SYNC:
            return ()
        out = []
        for i, chunk in enumerate(self._chunks):
            groups = [("dp", g) for g in chunk.bucket_groups]
            groups += [("expt_dp", g) for g in chunk.expert_parallel_bucket_groups]
            for j, (kind, group) in enumerate(groups):
                for bucket in group.buckets:
                    data = bucket.param_data
                    dtype = str(data.dtype).removeprefix("torch.")
                    out.append(Collective("all_gather", f"chunk{i}.{kind}.bg{j}", dtype, data.numel()))
        return tuple(out)

    # ----------------------------------------------------------- host copies

    @property
    def host_copies(self) -> HostCopies:
        """The persistent host buffers (their ``log`` records every copy's bytes and seconds)."""
        return self._host

    def _snapshot(self, tag: str, live: Mapping[str, torch.Tensor]) -> StepReport:
        """Copy ``live`` into ``tag``'s host copy, reusing its (pinned) buffer across cycles."""
        moved = self._host.save(tag, live).nbytes
        self._weight_tags.add(tag)
        return StepReport(bytes_moved=moved, host_bytes=self.host_bytes())

    def host_bytes(self, tag: str | None = None) -> int:
        """Host bytes of tensor data held by this driver's copies (of one tag, or all, optimizer state included)."""
        if tag is not None:
            return self._host.host_bytes(tag) if tag in self._host else 0
        keys = self._weight_tags | ({OPTIMIZER_KEY} if OPTIMIZER_KEY in self._host else set())
        return sum(self._host.host_bytes(k) for k in keys if k in self._host)

    def backup(self, tag: str) -> StepReport:
        """Host copy of ``tag``: the extras only for the actor under rematerialize, else everything."""
        if tag == ACTOR and self.strategy is Strategy.REMATERIALIZE:
            return self._snapshot(tag, self._extras())
        self._require_resident(f"back up {tag!r}", ("param_buffer",))
        return self._snapshot(tag, self.tensors())

    def restore(self, tag: str) -> StepReport:
        """Write ``tag``'s host copy into the live tensors (all of it, or the extras)."""
        self._held(tag)
        moved = self._host.load(tag, self.tensors()).nbytes
        return StepReport(bytes_moved=moved, host_bytes=self.host_bytes())

    def copy(self, src_tag: str, dst_tag: str) -> None:
        """Make ``dst_tag`` a full host copy of ``src_tag``.

        Under rematerialize the actor's host copy holds only the extras, so the
        bf16 params are read from the model: that needs ``param_buffer``
        resident (TRAINING or OFFLOADED), and is refused otherwise.
        """
        src = self._held(src_tag)
        if src_tag == ACTOR and self.strategy is Strategy.REMATERIALIZE:
            self._require_resident(f"copy {src_tag!r} to {dst_tag!r}", ("param_buffer",))
            full = dict(self.tensors())
            full.update(src)
            self._snapshot(dst_tag, full)
        else:
            self._snapshot(dst_tag, src)

    def get(self, tag: str) -> Mapping[str, torch.Tensor]:
        """The host copy held for ``tag`` (read-only mapping)."""
        return MappingProxyType(self._held(tag))

    def _held(self, tag: str) -> dict[str, torch.Tensor]:
        if tag not in self._weight_tags:
            raise HostCopyMissingError(tag=tag, held=sorted(self._weight_tags))
        return self._host.views(tag)

    def _require_resident(self, op: str, tags: Sequence[str]) -> None:
        paused = sorted(set(tags) & self._paused)
        if paused:
            raise MemoryReleasedError(owner="megatron trainer", op=op, tags=paused)

    # ------------------------------------------------------------ rematerialize

    def cast_main_to_params(self) -> StepReport:
        """Each inner distributed optimizer writes its fp32 master shard into the param buffer."""
        moved = 0
        for opt in self._inner:
            opt._copy_main_params_to_model_params()
            for group in opt.shard_fp32_from_float16_groups:
                moved += sum(p.numel() * 2 for p in group)
        return StepReport(bytes_moved=moved)

    def param_sync(self) -> StepReport:
        """A blocking all-gather of every bucket of every chunk."""
        moved = 0
        for chunk in self._chunks:
            chunk.start_param_sync(force_sync=True)
            moved += sum(b.param_data.numel() * b.param_data.element_size() for b in self._ddp_buffers(chunk))
        return StepReport(bytes_moved=moved)

    # ------------------------------------------------------------ memory

    def pause_memory(self, tag: str) -> None:
        if tag == _GRAD_TAG and self._optimizer_save_can_start():
            # The offload pauses grad_buffer, then default. Start the optimizer
            # state's D2H first and unmap grad_buffer while it crosses PCIe: the
            # device is idle but for copies of other memory, so the unmap needs
            # no device synchronization (measured on H200: 2-3 ms, not waiting
            # for a 16 GiB copy in flight).
            _synchronize(self._buffer_device())
            self._host.save(OPTIMIZER_KEY, self.optimizer_state(), wait=False)
            self._optimizer_saving = True
            if self._memory is not None:
                self._memory.pause(tag, synchronize=False)
            self._paused.add(tag)
            return
        if self._offloads_optimizer(tag):
            if self._optimizer_saving:
                self._host.synchronize()
                self._optimizer_saving = False
            else:
                self._host.save(OPTIMIZER_KEY, self.optimizer_state())
        if self._memory is not None:
            self._memory.pause(tag)
        self._paused.add(tag)

    def _optimizer_save_can_start(self) -> bool:
        return (
            self._config.optimizer_offload == "driver"
            and _OPTIMIZER_TAG not in self._paused
            and not self._optimizer_saving
        )

    def resume_memory(self, tag: str) -> None:
        if self._optimizer_saving:
            # A resume before default was paused: that early save is stale from
            # here on (training can start again), so finish it and forget it.
            self._host.synchronize()
            self._optimizer_saving = False
        if self._memory is not None:
            self._memory.resume(tag)
        self._paused.discard(tag)
        if self._offloads_optimizer(tag):
            # Queued, not awaited: the current stream waits for the loads, so the
            # cast and everything after it are ordered behind them, while the
            # host goes on with the transition's other steps.
            self._host.load(OPTIMIZER_KEY, self.optimizer_state(), wait=False)

    def _offloads_optimizer(self, tag: str) -> bool:
        return tag == _OPTIMIZER_TAG and self._config.optimizer_offload == "driver"

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Every storage the optimizer objects hold outside the DDP buffers, as flat byte tensors.

        Walked in a fixed order: per inner optimizer, the fp32 master shards,
        then each param's optimizer state (Adam's moments, a device step),
        then tensor attributes of the inner and chained optimizer objects
        (``_scale_one``, ``found_inf``). Views of one storage count once;
        storages inside a DDP param or grad buffer (the bf16 params, the
        main grads, fp32 params' shards) are left out: those tags are
        rebuilt, not restored. Only storages on the buffers' device count.
        """
        sources = self._optimizer_sources()
        # The walk is cheap; building the byte views is not (~10 us each, a thousand
        # of them): reuse them while every source is the same tensor at the same address.
        key = [(id(t), t.data_ptr()) for _, t in sources]
        cached = self._optimizer_views
        if cached is not None and cached[0] == key:
            return dict(cached[1])
        device = self._buffer_device()
        skip = self._ddp_storages()
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
        self._optimizer_views = (key, out, [t for _, t in sources])  # the sources stay alive: ids stay unique
        return dict(out)

    def _optimizer_sources(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the optimizer objects reference, named, in a fixed order."""
        out: list[tuple[str, torch.Tensor]] = []

        def add(name: str, t: Any) -> None:
            if isinstance(t, torch.Tensor):
                out.append((name, t))

        for k, opt in enumerate(self._inner):
            for attr in ("shard_fp32_from_float16_groups", "shard_fp32_groups"):
                for g, group in enumerate(getattr(opt, attr, None) or ()):
                    for i, t in enumerate(group):
                        add(f"opt{k}.{attr}.{g}.{i}", t)
            inner = getattr(opt, "optimizer", None)
            if inner is not None and hasattr(inner, "state"):
                for g, group in enumerate(inner.param_groups):
                    for i, p in enumerate(group["params"]):
                        for key, value in sorted(inner.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                            add(f"opt{k}.state.{g}.{i}.{key}", value)
            for attr, value in sorted(vars(opt).items()):
                add(f"opt{k}.{attr}", value)
        for attr, value in sorted(vars(self._optimizer).items()):
            add(f"chained.{attr}", value)
        return out

    def _buffer_device(self) -> torch.device:
        for chunk in self._chunks:
            for buf in self._ddp_buffers(chunk):
                data = getattr(buf, "param_data", None)
                if data is None:
                    data = buf.grad_data
                return data.device
        return next(p.device for _, p in self._named_params())

    def _ddp_storages(self) -> set[int]:
        out = set()
        for chunk in self._chunks:
            for buf in self._ddp_buffers(chunk):
                for attr in ("param_data", "grad_data"):
                    data = getattr(buf, attr, None)
                    if data is not None:
                        out.add(data.untyped_storage().data_ptr())
        return out

    def memory_in_use(self) -> int | None:
        """Device bytes in use (CUDA: the whole device), or the saver's resident bytes on CPU."""
        if torch.cuda.is_available() and any(p.is_cuda for _, p in self._named_params()):
            free, total = torch.cuda.mem_get_info()
            return total - free
        resident = getattr(self._memory, "resident_bytes", None)
        return int(resident()) if callable(resident) else None

    # ------------------------------------------------------------ engine push

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The params (whole, after the sync) and buffers, through ``convert`` if given."""
        self._require_resident("push weights", ("param_buffer",))
        for name, t in self.tensors().items():
            if self._convert is None:
                yield name, t
            else:
                yield from self._convert(name, t)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
