"""A miles-style trainer actor on Ray, its ``sleep`` / ``update_weights`` / ``wake_up`` mapped onto the lifecycle.

RL frameworks drive colocated trainer ranks as Ray actors with methods named
for what the GPU does; miles calls them ``sleep``, ``update_weights`` and
``wake_up`` and keeps the state in flags. Here each method fires the
lifecycle's transitions instead, so the flags become states, every rank's
moves are guarded, and a rank that diverges or dies fails every rank with an
error that names it, delivered to this controller as itself:

- ``sleep()``: ``offload`` (back up, free gradients and optimizer state;
  params stay for the push);
- ``update_weights()``: ``pause`` (push the weights to the engine, free the
  params, give the engine its KV cache);
- ``generate()``: the engine owns the GPU;
- ``wake_up()``: ``rematerialize``, ``sync``, ``resume`` (rebuild the params,
  all-gather, verify bit-exact);
- ``train()``: the train step, its collectives guarded.

    python examples/ray_actor.py --ranks 2 --steps 2      # needs: pip install ray
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from miles_fsm import GuardConfig, Lifecycle, LifecycleConfig, State, VerifyConfig
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.trainer import TrainerConfig
from miles_fsm.drivers.reference.engine import ReferenceEngine
from miles_fsm.drivers.reference.trainer import ReferenceTrainer


@ray.remote(num_cpus=1, max_restarts=0)
class TrainerActor:
    """One trainer rank with its colocated engine, as a framework's actor would hold them."""

    def __init__(self, rank: int, world: int, addr: str, port: int) -> None:
        timeout = timedelta(seconds=60)
        store = dist.TCPStore(addr, port, world + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        saver = CpuMemorySaver()  # one "device", shared by trainer and engine as a GPU is
        self.trainer = ReferenceTrainer(config=TrainerConfig(), saver=saver)
        self.engine = ReferenceEngine(saver=saver)
        config = LifecycleConfig(guard=GuardConfig(timeout_s=20), verify=VerifyConfig(cycles=None))
        self.lc = Lifecycle(trainer=self.trainer, engine=self.engine, config=config)
        self.lc.start()
        self.rank = rank

    def sleep(self) -> str:
        self.lc.offload()
        return self.lc.state.value

    def update_weights(self) -> str:
        self.lc.pause()
        return self.lc.state.value

    def generate(self, prompt_len: int = 8, new_tokens: int = 8) -> torch.Tensor:
        prompts = torch.randint(0, self.trainer.config.model.vocab, (4, prompt_len),
                                generator=torch.Generator().manual_seed(self.lc.epoch * 100 + self.rank))  # fmt: skip
        return self.engine.generate(prompts, max_new_tokens=new_tokens)

    def wake_up(self) -> str:
        for trigger in self.lc.definition.path(State.PAUSED, State.TRAINING) or ():
            self.lc.fire(trigger)
        return self.lc.state.value

    def train(self, rollouts: torch.Tensor, prompt_len: int = 8) -> float:
        self.lc.agree_on("train", self.trainer.train_collectives())
        reward = (rollouts[:, prompt_len:] % 2 == 0).float().sum(dim=1)
        return self.trainer.train_step(rollouts, reward - reward.mean(), prompt_len=prompt_len)

    def close(self) -> None:
        self.lc.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    ray.init(num_cpus=args.ranks, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})  # fmt: skip
    store = dist.TCPStore("127.0.0.1", 0, args.ranks + 1, is_master=True, wait_for_workers=False)
    actors = [TrainerActor.remote(r, args.ranks, "127.0.0.1", store.port) for r in range(args.ranks)]
    try:
        for step in range(1, args.steps + 1):
            states: dict[str, Any] = {}
            for method in ("sleep", "update_weights"):
                states[method] = ray.get([getattr(a, method).remote() for a in actors])
            rollouts = ray.get([a.generate.remote() for a in actors])
            states["wake_up"] = ray.get([a.wake_up.remote() for a in actors])
            losses = ray.get([a.train.remote(r) for a, r in zip(actors, rollouts)])
            print(f"step {step}: " + ", ".join(f"{m} -> {s[0]}" for m, s in states.items())
                  + f"; loss {sum(losses) / len(losses):.4f}; every rank verified bit-exact")  # fmt: skip
        ray.get([a.close.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
