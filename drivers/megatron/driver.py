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
rebuilt, so construction raises ``IneligibleModelError`` naming it, with a
suggestion per param (``drivers/eligibility.py``).

The collective plan (``collectives``) and the tensor set (``tensor_set``)
read only rank-uniform facts: bucket layout, names, shapes, dtypes. Neither
reads what is paused on this rank.

Memory goes through a ``MemorySaver`` (``drivers/cpu_memory.py`` on CPU,
torch_memory_saver on CUDA). ``ddp_buffers_in_tags`` places each DDP buffer's
``param_data`` under ``param_buffer`` and ``grad_data`` under
``grad_buffer`` while the chunks are built.

The buffer routing is in ``drivers/megatron/buffers.py``, the optimizer
state (coalescing it, its host copy) in ``drivers/megatron/optimizer.py``;
``ddp_buffers_in_tags``, ``coalesce_optimizer_state`` and ``OPTIMIZER_KEY``
are re-exported here, next to the driver they are used with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from miles_fsm.drivers.cpu_memory import PauseResume
from miles_fsm.drivers.eligibility import Eligibility, rematerialize_eligibility
from miles_fsm.drivers.errors import HostCopyMissingError
from miles_fsm.drivers.megatron.buffers import chunk_buffers, ddp_buffers_in_tags, tags_holding_params
from miles_fsm.drivers.megatron.config import MegatronDriverConfig, megatron_facts
from miles_fsm.drivers.megatron.optimizer import (
    OPTIMIZER_KEY,
    OptimizerOffload,
    coalesce_optimizer_state,
    inner_optimizers,
)
from miles_fsm.drivers.pinned import HostCopies, PinnedConfig
from miles_fsm.drivers.structure import registrations
from miles_fsm.errors import ConfigError, MemoryReleasedError
from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import Step, StepKind, Strategy
from miles_fsm.states.protocols import StepReport

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["ACTOR", "NON_ACTOR_TAGS", "OPTIMIZER_KEY", "MegatronTrainer", "PauseResume", "coalesce_optimizer_state",
           "ddp_buffers_in_tags"]  # fmt: skip

ACTOR = "actor"
NON_ACTOR_TAGS = ("ref", "teacher", "old_actor", "rollout_actor")
_HALF = (torch.bfloat16, torch.float16)


class MegatronTrainer:
    """``TrainerDriver`` over megatron-core DDP chunks and a (chained) distributed optimizer.

    Build it once the chunks and the optimizer exist, on every rank, with the
    same arguments; construction runs no collective.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[DistributedDataParallel],
        optimizer: MegatronOptimizer,
        config: MegatronDriverConfig | None = None,
        memory: PauseResume | None = None,
        convert: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
        host: HostCopies | None = None,
    ) -> None:
        if not chunks:
            raise ConfigError(["at least one DDP model chunk is needed"], "MegatronTrainer")
        self._chunks = tuple(chunks)
        self._optimizer = optimizer
        self._inner = inner_optimizers(optimizer)
        self._config = config or MegatronDriverConfig.from_megatron(self._chunks, optimizer)
        self._memory = memory
        self._convert = convert
        # Shared between drivers when given (one set of pinned buffers per process).
        self._host = host if host is not None else HostCopies(config=PinnedConfig(pin=self._config.pin_memory))
        self._weight_tags: set[str] = set()
        self._paused: set[str] = set()
        self._offload = OptimizerOffload(
            chunks=self._chunks,
            optimizer=optimizer,
            host=self._host,
            enabled=self._config.optimizer_offload == "driver",
        )
        # Rematerialize rebuilds only what sits in a DDP param buffer; anything else must be an extra.
        self._eligibility = rematerialize_eligibility(
            self._named_params(), in_buffers=self._in_buffers(), extras=self._config.extra_params
        )
        self._check_megatron_agrees()
        if self.strategy is Strategy.REMATERIALIZE:
            self._eligibility.raise_if_ineligible()
        self._extra_param_names = self._find_extra_params()
        self._walked: tuple[int, dict[str, torch.Tensor]] = (-1, {})

    @property
    def config(self) -> MegatronDriverConfig:
        return self._config

    @property
    def strategy(self) -> Strategy:
        return self._config.effective_strategy

    @property
    def chunks(self) -> tuple[DistributedDataParallel, ...]:
        return self._chunks

    @property
    def optimizer(self) -> MegatronOptimizer:
        """The (chained) optimizer the driver was built with."""
        return self._optimizer

    @property
    def eligibility(self) -> Eligibility:
        """The params outside every DDP param buffer and not among the extras (refused under rematerialize)."""
        return self._eligibility

    @property
    def inner_optimizers(self) -> tuple[MegatronOptimizer, ...]:
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

    def _in_buffers(self) -> set[int]:
        return {id(p) for chunk in self._chunks for buf in chunk_buffers(chunk) for p in buf.params}

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
                for j, buf in enumerate(chunk_buffers(chunk)):
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
        for unknown in self._eligibility.unknown_extras:
            problems.append(f"extra_params: {unknown.hint}")
        if problems:
            raise ConfigError(problems, "MegatronTrainer (config vs. megatron objects)")

    def _find_extra_params(self) -> tuple[str, ...]:
        """Params rematerialize cannot rebuild: fp32 ones (their master is the param buffer itself),
        and the ones the config names. A structural, rank-uniform fact."""
        extras = set(self._config.extra_params)
        return tuple(n for n, p in self._named_params() if p.dtype not in _HALF or n in extras)

    # ------------------------------------------------------------ tensor views

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every param and buffer of the actor, live (verification hashes these). The walk is kept while
        ``structure_version`` stands (a verified cycle asks twice); ``tensor_set()`` always walks anew,
        so the lifecycle's re-walk still sees what the version cannot."""
        if self._walked[0] != self.structure_version:
            self._walked = (self.structure_version, self._walk())
        return MappingProxyType(self._walked[1])

    def _walk(self) -> dict[str, torch.Tensor]:
        return {**dict(self._named_params()), **dict(self._named_buffers())}

    def _extras(self) -> dict[str, torch.Tensor]:
        live = self.tensors()
        names = list(self._extra_param_names) + [n for n, _ in self._named_buffers()]
        return {n: live[n] for n in names}

    @property
    def verified_tags(self) -> frozenset[str] | None:
        """The tags that hold ``tensors()`` (a verification join waits only before pausing these)."""
        return tags_holding_params(self._chunks, self._named_params(), self._named_buffers())

    def tensor_set(self) -> TensorSet:
        """Names, shapes and dtypes of the params and buffers; never reads pause state."""
        return TensorSet.of(self._walk().items())

    @property
    def structure_version(self) -> int:
        """Changes whenever ``tensor_set()`` could: torch's module registrations in this process.

        The lifecycle walks the tensor set again only when it changes (see
        ``drivers/structure.py`` for what it cannot see, and the re-walk that covers it).
        """
        return registrations()

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
            moved += sum(b.param_data.numel() * b.param_data.element_size() for b in chunk_buffers(chunk))
        return StepReport(bytes_moved=moved)

    # ------------------------------------------------------------ memory

    def pause_memory(self, tag: str) -> None:
        unsynchronized = self._offload.before_pause(tag, self._paused)
        if self._memory is not None:
            if unsynchronized:
                self._memory.pause(tag, synchronize=False)
            else:
                self._memory.pause(tag)
        self._paused.add(tag)

    def resume_memory(self, tag: str) -> None:
        self._offload.before_resume()
        if self._memory is not None:
            self._memory.resume(tag)
        self._paused.discard(tag)
        self._offload.after_resume(tag)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Every storage the optimizer objects hold outside the DDP buffers, as flat byte tensors.

        See ``OptimizerOffload.state`` for what counts and in what order.
        """
        return self._offload.state()

    def memory_in_use(self) -> int | None:
        """Device bytes in use (CUDA: the whole device), or the saver's resident bytes on CPU."""
        if torch.cuda.is_available() and any(p.is_cuda for _, p in self._named_params()):
            free, total = torch.cuda.mem_get_info()
            return total - free
        resident = getattr(self._memory, "resident_bytes", None)
        return int(resident()) if callable(resident) else None

    def device_bytes_by_tag(self) -> dict[str, int]:
        """The drift snapshot's device figure (states/drift.py): the device in use (the snapshot adds torch's own)."""
        in_use = self.memory_in_use()
        return {"in_use": in_use} if in_use is not None else {}

    def host_bytes_by_tag(self) -> dict[str, int]:
        """Host bytes of each host copy's buffer (pinned where configured), per tag, and of the saver's own backups."""
        out = {key: self._host.reserved_bytes(key) for key in self._host.keys()}
        backups = getattr(self._memory, "host_bytes", None)  # torch_memory_saver's CPU backups, per its ledger
        return {**out, "saver_backups": int(backups())} if callable(backups) else out

    # ------------------------------------------------------------ engine push

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The params (whole, after the sync) and buffers, through ``convert`` if given."""
        self._require_resident("push weights", ("param_buffer",))
        for name, t in self.tensors().items():
            if self._convert is None:
                yield name, t
            else:
                yield from self._convert(name, t)
