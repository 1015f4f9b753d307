"""The reference rollout engine: in-process, its own copy of the model, SGLang's rules.

It behaves like SGLang where the lifecycle cares:

- memory is released and resumed by tag (``weights``, ``kv_cache``) through
  a ``MemorySaver``; releasing a released tag or resuming an active one is
  refused (SGLang would kill the scheduler; we raise ``MemoryTagError``);
- after a ``weights`` resume the contents are garbage (poisoned), so weights
  must be pushed again before generating;
- weights change only inside a session: ``begin_weight_update``, then
  ``update_weights_from_tensor`` (any number), then ``end_weight_update``,
  which sets the weight version;
- ``generate`` is greedy decoding with a KV cache in the ``kv_cache`` tag;
  it raises ``MemoryReleasedError`` while weights or KV cache are released,
  or while the weights are garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from miles_fsm.digest import digest_tensors
from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
from miles_fsm.drivers.errors import EngineSessionError
from miles_fsm.drivers.reference.model import KVCache, ModelConfig, forward, weight_specs
from miles_fsm.errors import MemoryReleasedError
from miles_fsm.plan import Collective
from miles_fsm.states import Step
from miles_fsm.states.protocols import StepReport

__all__ = ["EngineConfig", "ReferenceEngine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The engine's model (same shape as the trainer's) and its KV cache size."""

    model: ModelConfig = field(default_factory=ModelConfig)
    max_batch: int = 8
    name: str = "engine0"


class ReferenceEngine:
    """An in-process engine; implements ``EngineDriver``."""

    TAGS = ("weights", "kv_cache")

    def __init__(self, *, config: EngineConfig | None = None, saver: MemorySaver | None = None) -> None:
        self.config = config or EngineConfig()
        cfg = self.config.model
        self.saver: MemorySaver = saver if saver is not None else CpuMemorySaver(name=f"{self.config.name}-memory")
        self._specs = {s.name: s for s in weight_specs(cfg)}
        self._weights: dict[str, torch.Tensor] = {}
        for s in self._specs.values():  # one region per dtype keeps the layout simple
            self._weights[s.name] = self.saver.empty("weights", s.numel, s.dtype).view(s.shape)
        per_layer = self.config.max_batch * cfg.heads * cfg.max_seq * cfg.head_dim
        kv = self.saver.empty("kv_cache", 2 * cfg.layers * per_layer, torch.float32)
        shape = (self.config.max_batch, cfg.heads, cfg.max_seq, cfg.head_dim)
        chunks = kv.view(2, cfg.layers, *shape)
        self._cache = KVCache(k=list(chunks[0]), v=list(chunks[1]))
        self._version: str | None = None
        self._session: set[str] | None = None
        # False until a full push: the weights start as zeros and come back as garbage after a resume.
        self._loaded = False

    @property
    def name(self) -> str:
        return self.config.name

    # ----------------------------------------------------------------- memory

    def release_memory(self, tag: str) -> None:
        self._check_tag(tag)
        if self._session is not None:
            raise EngineSessionError(engine=self.name, op=f"release_memory({tag})", detail="a weight update is open")
        self.saver.pause(tag)

    def resume_memory(self, tag: str) -> None:
        self._check_tag(tag)
        self.saver.resume(tag)
        if tag == "weights":
            self._loaded = False

    def device_bytes_by_tag(self) -> dict[str, int]:
        """The saver's resident bytes per engine tag (the drift snapshot's engine figures)."""
        return {tag: self.saver.resident_bytes((tag,)) for tag in self.TAGS}

    def host_bytes_by_tag(self) -> dict[str, int]:
        return {tag: self.saver.host_bytes((tag,)) for tag in self.TAGS}

    def _check_tag(self, tag: str) -> None:
        if tag not in self.TAGS:
            raise KeyError(f"engine {self.name} has no memory tag {tag!r}; it has {list(self.TAGS)}")

    # --------------------------------------------------------- weight update

    def begin_weight_update(self) -> None:
        if self._session is not None:
            raise EngineSessionError(engine=self.name, op="begin_weight_update", detail="a session is already open")
        self._session = set()

    def update_weights_from_tensor(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy pushed tensors into the served weights; returns bytes copied."""
        if self._session is None:
            raise EngineSessionError(
                engine=self.name, op="update_weights_from_tensor", detail="no session; call begin_weight_update first"
            )
        self._require(("weights",), "update_weights_from_tensor")
        moved = 0
        for name, tensor in named:
            spec = self._specs.get(name)
            if spec is None:
                raise EngineSessionError(
                    engine=self.name, op="update_weights_from_tensor", detail=f"unknown weight {name!r}"
                )
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise EngineSessionError(
                    engine=self.name,
                    op="update_weights_from_tensor",
                    detail=f"{name}: got {list(tensor.shape)}:{tensor.dtype}, serves {list(spec.shape)}:{spec.dtype}",
                )
            self._weights[name].copy_(tensor)
            self._session.add(name)
            moved += tensor.numel() * tensor.element_size()
        return moved

    def end_weight_update(self, *, version: str | None = None) -> None:
        if self._session is None:
            raise EngineSessionError(engine=self.name, op="end_weight_update", detail="no session is open")
        pushed, self._session = self._session, None
        missing = sorted(set(self._specs) - pushed)
        if missing and not self._loaded:
            raise EngineSessionError(
                engine=self.name,
                op="end_weight_update",
                detail=f"weights are garbage since their resume and {len(missing)} were not pushed: {missing[:4]}",
            )
        self._loaded = True
        if version is not None:
            self._version = version

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str) -> StepReport:
        self.begin_weight_update()
        try:
            moved = self.update_weights_from_tensor(named)
        except BaseException:
            self._session = None  # the session is abandoned with the error; the weights stay not-loaded
            self._loaded = False
            raise
        self.end_weight_update(version=version)
        return StepReport(bytes_moved=moved)

    def weight_version(self) -> str | None:
        return self._version

    def weight_digests(self) -> Mapping[str, str]:
        self._require(("weights",), "weight_digests")
        return digest_tensors(self._weights)

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        return ()  # in-process: the push is a local copy

    # ------------------------------------------------------------ generation

    def generate(self, prompts: torch.Tensor, *, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of ``prompts`` ``[batch, P]``; returns ``[batch, P + max_new_tokens]``."""
        self._require(("weights", "kv_cache"), "generate")
        if not self._loaded:
            raise MemoryReleasedError(
                owner=f"engine {self.name}", op="generate", tags=["weights"],
                reason="they were resumed without a backup and not pushed since",
            )
        cfg = self.config.model
        b, p = prompts.shape
        if b > self.config.max_batch or p + max_new_tokens > cfg.max_seq:
            raise ValueError(
                f"engine {self.name}: batch {b} x {p}+{max_new_tokens} tokens exceeds max_batch "
                f"{self.config.max_batch} x max_seq {cfg.max_seq}"
            )
        out = prompts.clone()
        with torch.no_grad():
            logits = forward(self._weights, prompts, cfg, cache=self._cache, start=0)
            for pos in range(p, p + max_new_tokens):
                nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
                out = torch.cat([out, nxt], dim=1)
                if pos + 1 < p + max_new_tokens:
                    logits = forward(self._weights, nxt, cfg, cache=self._cache, start=pos)
        return out

    def _require(self, tags: Iterable[str], op: str) -> None:
        released = sorted(set(tags) & self.saver.paused_tags)
        if released:
            raise MemoryReleasedError(owner=f"engine {self.name}", op=op, tags=released)
