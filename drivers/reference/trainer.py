"""The reference trainer: a tiny decoder-only LM laid out like megatron-core.

Pure torch, CPU or any device, one instance per data-parallel rank:

- every bf16 param is a view into ONE flat param buffer (``param_buffer`` tag),
  padded to a multiple of the world size;
- the fp32 master weights are sharded: rank ``r`` owns the contiguous slice
  ``[r * S, (r + 1) * S)`` of the flat buffer (megatron's distributed
  optimizer), with Adam's moments for that slice only (``default`` tag,
  allocated with backup, like the optimizer state in miles);
- gradients land in one flat fp32 grad buffer (``grad_buffer`` tag) and are
  reduce-scattered; the param sync all-gathers the flat bf16 buffer;
- the *extras* live outside the flat buffer: an fp32 param (``head.scale``,
  megatron keeps some params in fp32) and a non-param buffer
  (``head.logit_bias``, like MoE's ``expert_bias``). They are replicated and
  updated identically on every rank.

Weight strategies (``Strategy``):

- ``rematerialize``: ``backup("actor")`` keeps only the extras on the host. The
  bf16 params come back from ``cast_main_to_params`` (this rank's shard) and
  ``param_sync`` (everyone else's). No host copy of a bf16 param exists.
- ``backup``: ``backup(tag)`` keeps a full host copy of every weight. Tags other than ``actor``
  (``ref``, ``old_actor``, ...) always keep full copies.

The model itself is in ``drivers/reference/model.py`` (shared with the engine; ``ModelConfig`` is
re-exported); this module holds the buffer layout, Adam on the owned shard and the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
from miles_fsm.drivers.eligibility import rematerialize_eligibility
from miles_fsm.drivers.errors import HostCopyMissingError
from miles_fsm.drivers.reference.model import ModelConfig, WeightSpec, forward, initial_value, weight_specs
from miles_fsm.errors import ConfigError, MemoryReleasedError
from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import TRAINER_TAGS, Step, StepKind, Strategy
from miles_fsm.states.protocols import StepReport

__all__ = ["AdamConfig", "ModelConfig", "ReferenceTrainer", "TrainerConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """What a ``ReferenceTrainer`` is built from.

    ``frozen`` names params that are not trained: they sit outside the flat
    buffer, so ``rematerialize`` cannot rebuild them and refuses at init
    (the seed's known case: frozen ``nn.Parameter`` objects that DDP skips).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: Strategy = Strategy.REMATERIALIZE
    adam: AdamConfig = field(default_factory=AdamConfig)
    frozen: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        names = {s.name for s in weight_specs(self.model) if s.kind == "param"}
        unknown = sorted(set(self.frozen) - names)
        if unknown:
            raise ConfigError([f"frozen names no bf16 param of the model: {', '.join(unknown)}"], "TrainerConfig")


class ReferenceTrainer:
    """One data-parallel rank of the reference trainer; implements ``TrainerDriver``.

    Uses the default process group when it is initialized (world > 1 shards
    the optimizer), else runs as world 1. Allocates through ``saver`` (a new
    ``CpuMemorySaver`` by default) under the tags ``param_buffer``,
    ``grad_buffer`` and ``default``.
    """

    def __init__(self, *, config: TrainerConfig | None = None, saver: MemorySaver | None = None) -> None:
        self.config = config or TrainerConfig()
        cfg = self.config.model
        self.saver: MemorySaver = saver if saver is not None else CpuMemorySaver()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        specs = weight_specs(cfg)
        self._specs = {s.name: s for s in specs}
        frozen = self.config.frozen
        self._buffered = [s for s in specs if s.kind == "param" and s.name not in frozen]
        self._extras = [s for s in specs if s.kind != "param"]
        self._frozen = [s for s in specs if s.name in frozen]
        numel = sum(s.numel for s in self._buffered)
        self.padded_numel = -(-numel // self.world) * self.world
        self.shard_numel = self.padded_numel // self.world
        self._offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for s in self._buffered:
            self._offsets[s.name] = (off, off + s.numel)
            off += s.numel

        saver_ = self.saver
        self.flat = saver_.empty("param_buffer", self.padded_numel, torch.bfloat16)
        n_extra = sum(s.numel for s in self._extras)
        self.extras_flat = saver_.empty("param_buffer", n_extra, torch.float32)
        frozen_flat = saver_.empty("param_buffer", sum(s.numel for s in self._frozen), torch.bfloat16)
        self.grad_flat = saver_.empty("grad_buffer", self.padded_numel, torch.float32)
        n_xp = sum(s.numel for s in self._extras if s.kind == "fp32_param")
        self.extras_grad = saver_.empty("grad_buffer", n_xp, torch.float32)
        # Optimizer state: this rank's master shard and moments, plus the
        # replicated fp32 extras' moments. Backed up by the saver, like miles.
        opt = saver_.empty("default", 3 * self.shard_numel + 2 * n_xp, torch.float32, backup=True)
        s_n = self.shard_numel
        self.main_shard, self.exp_avg, self.exp_avg_sq = opt[:s_n], opt[s_n : 2 * s_n], opt[2 * s_n : 3 * s_n]
        self.extras_exp_avg, self.extras_exp_avg_sq = opt[3 * s_n : 3 * s_n + n_xp], opt[3 * s_n + n_xp :]
        self.step_count = 0

        self.params = {s.name: self.flat[slice(*self._offsets[s.name])].view(s.shape) for s in self._buffered}
        self.extras = _views(self.extras_flat, self._extras)
        self.frozen = _views(frozen_flat, self._frozen)
        if self.strategy is Strategy.REMATERIALIZE:
            # The same structural check as megatron's: a param outside the flat buffer cannot be rebuilt.
            rematerialize_eligibility(
                {**self.params, **self.frozen}.items(), in_buffers=_sharing(self.flat)
            ).raise_if_ineligible()
        gen = torch.Generator().manual_seed(cfg.seed)
        for s in specs:  # same seed, same order on every rank: identical init
            value = initial_value(s, gen)
            self.weights()[s.name].copy_(value)
        self.main_shard.copy_(self.flat[self.shard].float())
        self._host: dict[str, dict[str, torch.Tensor]] = {}

    # ----------------------------------------------------------------- facts

    @property
    def strategy(self) -> Strategy:
        return self.config.strategy

    @property
    def shard(self) -> slice:
        """This rank's slice of the flat buffer."""
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every live weight by name (views, no copies). Refused while ``param_buffer`` is released:
        a read of released memory is a crash on CPU as on a GPU, never data."""
        self._require_resident("read the weights", ("param_buffer",))
        return self._weight_views()

    def _weight_views(self) -> dict[str, torch.Tensor]:
        # Names, shapes and dtypes are there whatever the memory state; bytes only while resident.
        return {**self.params, **self.frozen, **self.extras}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's tensors by name (views). Refused while ``default`` is released."""
        self._require_resident("read the optimizer state", ("default",))
        return {
            "optimizer.main_shard": self.main_shard,
            "optimizer.exp_avg": self.exp_avg,
            "optimizer.exp_avg_sq": self.exp_avg_sq,
            "optimizer.extras_exp_avg": self.extras_exp_avg,
            "optimizer.extras_exp_avg_sq": self.extras_exp_avg_sq,
        }

    def owners(self, names: Iterable[str]) -> set[int]:
        """Ranks whose master shard (or own state) produced these tensors' bytes.

        A bf16 param belongs to every rank whose shard overlaps it; optimizer
        state and extras belong to this rank.
        """
        out: set[int] = set()
        for name in names:
            if name in self._offsets:
                a, b = self._offsets[name]
                out.update(range(a // self.shard_numel, (b - 1) // self.shard_numel + 1))
            else:
                out.add(self.rank)
        return out

    def param_within_shard(self, rank: int) -> str | None:
        """A bf16 param that lies wholly inside ``rank``'s shard, if any."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        return next((n for n, (a, b) in self._offsets.items() if lo <= a and b <= hi), None)

    def offset_of(self, name: str) -> tuple[int, int]:
        """``[start, end)`` of a bf16 param in the flat buffer."""
        return self._offsets[name]

    # ------------------------------------------------------- TrainerDriver

    def backup(self, tag: str) -> StepReport:
        self._require_resident(f"backup({tag})", ("param_buffer",))
        src = self.extras if self._partial(tag) else self.weights()
        self._host[tag] = {n: t.detach().clone() for n, t in src.items()}
        return StepReport(bytes_moved=_nbytes(self._host[tag].values()), host_bytes=self.backup_host_bytes())

    def restore(self, tag: str) -> StepReport:
        if tag not in self._host:
            raise HostCopyMissingError(tag=tag, held=list(self._host))
        self._require_resident("restore", ("param_buffer",))
        live = self.weights()
        for name, host in self._host[tag].items():
            live[name].copy_(host)
        return StepReport(bytes_moved=_nbytes(self._host[tag].values()), host_bytes=self.backup_host_bytes())

    def copy(self, src_tag: str, dst_tag: str) -> None:
        if self._partial(src_tag):
            raise ConfigError(
                [f"copy({src_tag!r}, {dst_tag!r}) under rematerialize: {src_tag!r} holds no host copy of the bf16 "
                 "params (keep_old_actor is not supported with rematerialize); backup the destination tag instead"],
                "ReferenceTrainer.copy",
            )
        if src_tag not in self._host:
            raise HostCopyMissingError(tag=src_tag, held=list(self._host))
        self._host[dst_tag] = {n: t.clone() for n, t in self._host[src_tag].items()}

    def get(self, tag: str) -> Mapping[str, torch.Tensor]:
        if tag not in self._host:
            raise HostCopyMissingError(tag=tag, held=list(self._host))
        return dict(self._host[tag])

    def cast_main_to_params(self) -> StepReport:
        self._require_resident("cast_main_to_params", ("param_buffer", "default"))
        self.flat[self.shard].copy_(self.main_shard)
        return StepReport(bytes_moved=self.shard_numel * (4 + 2))

    def param_sync(self) -> StepReport:
        self._require_resident("param_sync", ("param_buffer",))
        if self.world > 1:
            _all_gather(self.flat, self.flat[self.shard].clone())
        return StepReport(bytes_moved=self.padded_numel * 2)

    def pause_memory(self, tag: str) -> None:
        self.saver.pause(tag)

    def resume_memory(self, tag: str) -> None:
        self.saver.resume(tag)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        # Handing out views of released storage would let a reader (a hash, a
        # copy) touch freed memory; refuse instead.
        self._require_resident("named_weights", ("param_buffer",))
        return list(self.weights().items())

    def tensors(self) -> dict[str, torch.Tensor]:
        self._require_resident("tensors", ("param_buffer", "default"))
        return {**self.weights(), **self.optimizer_state()}

    def tensor_set(self) -> TensorSet:
        # Metadata only: the plan must not depend on this rank's pause state (the seed's hang).
        return TensorSet.of(self._weight_views().items())

    @property
    def structure_version(self) -> object:
        """Changes whenever ``tensor_set()`` would: never, here, as the layout is the config's.

        A subclass that changes its tensor set (the demo's ``diverge``) defines its own.
        """
        return 0

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        if step.kind is StepKind.PARAM_SYNC and self.world > 1:
            return (Collective("all_gather", "dp", "bfloat16", self.padded_numel),)
        return ()

    def memory_in_use(self) -> int:
        return self.saver.resident_bytes(TRAINER_TAGS)

    def device_bytes_by_tag(self) -> dict[str, int]:  # the drift snapshot's figures (states/drift.py)
        return {tag: self.saver.resident_bytes((tag,)) for tag in TRAINER_TAGS}

    def host_bytes_by_tag(self) -> dict[str, int]:  # backups per backup tag; the saver's copies per memory tag
        return {**{t: self.backup_host_bytes(t) for t in self._host}, **{t: self.saver.host_bytes((t,)) for t in TRAINER_TAGS}}

    # ------------------------------------------------------------ host bytes

    def backup_host_bytes(self, tag: str | None = None) -> int:
        """Host bytes held by this trainer's backups (one tag, or all)."""
        tags = self._host if tag is None else {tag: self._host.get(tag, {})}
        return sum(_nbytes(h.values()) for h in tags.values())

    def host_bf16_param_bytes(self) -> int:
        """Host bytes of bf16 params held in the actor tag's copy (rematerialize: 0)."""
        held = self._host.get("actor", {})
        return _nbytes(t for n, t in held.items() if n in self.params)

    def _partial(self, tag: str) -> bool:
        return tag == "actor" and self.strategy is Strategy.REMATERIALIZE

    def _require_resident(self, op: str, tags: Iterable[str]) -> None:
        paused = sorted(set(tags) & self.saver.paused_tags)
        if paused:
            raise MemoryReleasedError(owner=f"trainer rank {self.rank}", op=op, tags=paused)

    # -------------------------------------------------------------- training

    def train_collectives(self) -> tuple[Collective, ...]:
        """What ``train_step`` issues, for a guard in front of it. Rank-uniform."""
        if self.world == 1:
            return ()
        n_xp = self.extras_grad.numel()
        return (
            Collective("reduce_scatter", "dp", "float32", self.padded_numel),
            Collective("all_reduce", "dp", "float32", n_xp + self.config.model.vocab),
            Collective("all_gather", "dp", "bfloat16", self.padded_numel),
        )

    def train_step(self, tokens: torch.Tensor, advantages: torch.Tensor, *, prompt_len: int) -> float:
        """One policy-gradient step on rollouts ``tokens`` ``[batch, T]``; returns the local loss.

        Loss: next-token cross entropy over the whole sequence, minus the
        advantage-weighted log-probability of the generated tokens.
        Gradients are reduce-scattered into the master shard's Adam, the
        extras' gradients all-reduced, and the new params all-gathered.
        """
        self._require_resident("train", TRAINER_TAGS)
        cfg = self.config.model
        leaf = self.flat.detach().requires_grad_(True)
        scale = self.extras["head.scale"].detach().requires_grad_(True)
        w: dict[str, torch.Tensor] = {n: leaf[a:b].view(self._specs[n].shape) for n, (a, b) in self._offsets.items()}
        w.update(self.frozen)
        w["head.scale"] = scale
        w["head.logit_bias"] = self.extras["head.logit_bias"]
        logits = forward(w, tokens[:, :-1], cfg)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        gen_logp = logp[:, prompt_len - 1 :].sum(dim=1)
        loss = -logp.mean() - (advantages * gen_logp).mean() * 0.1
        g_flat, g_scale = torch.autograd.grad(loss, [leaf, scale])
        self.grad_flat.copy_(g_flat)
        self.extras_grad.copy_(g_scale.reshape(-1))
        counts = torch.bincount(tokens.reshape(-1), minlength=cfg.vocab).float()

        shard_grad = torch.empty(self.shard_numel)
        reduced = torch.cat([self.extras_grad, counts])
        if self.world > 1:
            _reduce_scatter(shard_grad, self.grad_flat)
            dist.all_reduce(reduced)
        else:
            shard_grad.copy_(self.grad_flat)
        shard_grad /= self.world
        n_xp = self.extras_grad.numel()
        xgrad, counts = reduced[:n_xp] / self.world, reduced[n_xp:]

        self.step_count += 1
        adam = self.config.adam
        _adam(self.main_shard, shard_grad, self.exp_avg, self.exp_avg_sq, self.step_count, adam)
        _adam(self.extras["head.scale"], xgrad, self.extras_exp_avg, self.extras_exp_avg_sq, self.step_count, adam)
        bias = self.extras["head.logit_bias"]
        bias.mul_(0.9).sub_(0.1 * torch.log1p(counts) / max(1.0, float(counts.sum())))
        self.cast_main_to_params()
        self.param_sync()
        return float(loss.detach())


def _views(flat: torch.Tensor, specs: list[WeightSpec]) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for s in specs:
        out[s.name] = flat[off : off + s.numel].view(s.shape)
        off += s.numel
    return out


def _sharing(flat: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is a view into ``flat``'s storage."""
    ptr = flat.untyped_storage().data_ptr()
    return lambda t: t.untyped_storage().data_ptr() == ptr


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adam(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, cfg: AdamConfig
) -> None:
    p_flat = p.view(-1)
    m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    m_hat = m / (1 - cfg.beta1**step)
    v_hat = v / (1 - cfg.beta2**step)
    p_flat.sub_(cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps))


# torch 2.13 deprecates the *_tensor names in favour of *_single; older torch
# (2.11 on the GPU host) has only the former.
def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)
