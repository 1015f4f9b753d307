"""A minimal trainer and engine driver for the engine's own tests.

It does real work (bf16 params rebuilt from an fp32 master shard, a real gloo
all-gather for the param sync) and records every driver call, so tests can
prove what ran and what did not. The full reference stack lives in
``miles_fsm.drivers``; these stay small on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from miles_fsm.states import StepReport
from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import Step, StepKind, Strategy


class ToyTrainer:
    def __init__(self, *, numel: int = 64, strategy: Strategy = Strategy.REMATERIALIZE, frozen: Iterable[str] = ()):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._strategy = strategy
        self.numel = numel * self.world
        g = torch.Generator().manual_seed(0)
        self.master = torch.randn(self.numel, generator=g)  # fp32, whole; we own a shard
        self.params = {"w": self.master.to(torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16)}
        self.frozen = set(frozen)
        self.host: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: list[str] = []
        self.fail_on: str | None = None

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail_on == name:
            raise RuntimeError(f"injected failure in {name}")

    def _shard(self) -> slice:
        n = self.numel // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    def backup(self, tag: str) -> StepReport:
        self._call(f"backup:{tag}")
        self.host[tag] = {k: v.clone() for k, v in self.params.items()}
        return StepReport(bytes_moved=sum(v.numel() * 2 for v in self.params.values()))

    def restore(self, tag: str) -> StepReport | None:
        self._call(f"restore:{tag}")
        if self._strategy is Strategy.BACKUP:
            for k, v in self.host[tag].items():
                self.params[k].copy_(v)
        else:
            self.params["b"].copy_(self.host[tag]["b"])
        return None

    def copy(self, src_tag: str, dst_tag: str) -> None:
        self.host[dst_tag] = {k: v.clone() for k, v in self.host[src_tag].items()}

    def get(self, tag: str) -> Mapping[str, torch.Tensor]:
        return self.host[tag]

    def cast_main_to_params(self) -> None:
        self._call("cast_main_to_params")
        s = self._shard()
        self.params["w"][s].copy_(self.master[s].to(torch.bfloat16))

    def param_sync(self) -> None:
        self._call("param_sync")
        if self.world > 1:
            s = self._shard()
            chunks = list(torch.empty_like(self.params["w"]).chunk(self.world))
            dist.all_gather(chunks, self.params["w"][s].contiguous())
            self.params["w"].copy_(torch.cat(chunks))

    def pause_memory(self, tag: str) -> None:
        self._call(f"pause:{tag}")
        if tag == "param_buffer":
            self.params["w"].fill_(float("nan"))

    def resume_memory(self, tag: str) -> None:
        self._call(f"resume:{tag}")

    def named_weights(self):
        return list(self.params.items())

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return dict(self.params)

    def tensor_set(self) -> TensorSet:
        return TensorSet.of((k, v) for k, v in self.params.items() if k not in self.frozen)

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        if step.kind is StepKind.PARAM_SYNC and self.world > 1:
            numel = sum(v.numel() for k, v in self.params.items() if k == "w" and k not in self.frozen)
            return (Collective("all_gather", "dp", "bfloat16", numel),)
        return ()

    def memory_in_use(self) -> int | None:
        return None


class ToyEngine:
    name = "toy-engine"

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.calls: list[str] = []

    def release_memory(self, tag: str) -> None:
        self.calls.append(f"release:{tag}")

    def resume_memory(self, tag: str) -> None:
        self.calls.append(f"resume:{tag}")

    def update_weights(self, named, *, version: str) -> None:
        self.calls.append("update")
        self.weights = {k: v.clone() for k, v in named}
        self.version = version

    def weight_version(self) -> str | None:
        return self.version

    def weight_digests(self):
        from miles_fsm.digest import digest_tensors

        return digest_tensors(self.weights)

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        return ()
