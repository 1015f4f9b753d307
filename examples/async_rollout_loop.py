"""An async RL rollout loop on the reference trainer and engine, driven through ``miles_fsm.aio.machine``.

Each RL step:

1. ``async with alc.rollout()``: the trainer offloads and pauses; the pause
   pushes its weights into the engine and gives the engine its memory back;
2. inside the window, many generation requests run as concurrent tasks. An
   engine server task batches them (like SGLang's scheduler); before every
   batch it awaits ``alc.wait_for(State.PAUSED)``, so it can never generate
   on memory the trainer holds;
3. a reward task per rollout scores it (an async call, like a reward model
   over HTTP); rewards that are still being computed when the window closes
   simply overlap the way back (rematerialize, sync, resume);
4. leaving the window rematerializes, syncs and resumes (verified bit-exact),
   and the training step runs in a worker thread.

A heartbeat task ticks every 5 ms all along; the run reports the worst gap
between its ticks (the event loop's worst stall). A monitor task prints every
state change from ``alc.changes()``.

Run it::

    python examples/async_rollout_loop.py                 # 1 rank, asyncio
    python examples/async_rollout_loop.py --backend trio --steps 5
    python examples/async_rollout_loop.py --ranks 2       # 2 gloo ranks on CPU

``--json`` prints one summary object instead of the log; the exit code is 0
only if every step ran and every cycle was verified.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import orjson
import torch
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.trainer import ModelConfig, ReferenceTrainer, TrainerConfig
from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
from miles_fsm.states import State

from miles_fsm import AsyncLifecycle, GuardConfig, Lifecycle, LifecycleConfig, VerifyConfig, run_ranks
from miles_fsm.aio import StateChanges
from miles_fsm.launch import RankContext


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    steps: int = 3
    requests: int = 16  # generation requests per step, each one prompt
    max_batch: int = 8  # the engine server batches up to this many
    prompt_len: int = 8
    new_tokens: int = 8
    reward_latency_s: float = 0.01
    guard_timeout_s: float = 30.0
    backend: str = "asyncio"
    trace_dir: str | None = None
    log: bool = True


@dataclass(slots=True)
class _Request:
    prompt: torch.Tensor
    done: anyio.Event
    tokens: torch.Tensor | None = None


class EngineServer:
    """Batches concurrent generation requests onto one engine, only while the engine holds the GPU."""

    def __init__(self, engine: ReferenceEngine, alc: AsyncLifecycle, *, max_batch: int) -> None:
        self._engine = engine
        self._alc = alc
        self._max_batch = max_batch
        self._send, self._receive = anyio.create_memory_object_stream[_Request](math.inf)
        self.batches = 0

    async def generate(self, prompt: torch.Tensor) -> torch.Tensor:
        """What a rollout task awaits: one completion."""
        request = _Request(prompt=prompt, done=anyio.Event())
        await self._send.send(request)
        await request.done.wait()
        if request.tokens is None:  # serve() sets tokens before done; never hand back nothing
            raise RuntimeError("the engine server finished a request without its tokens")
        return request.tokens

    async def serve(self, *, new_tokens: int) -> None:
        async with self._receive:
            async for first in self._receive:
                batch = [first]
                while len(batch) < self._max_batch:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                # The engine has its memory only while the trainer is PAUSED.
                await self._alc.wait_for(State.PAUSED)
                prompts = torch.stack([r.prompt for r in batch])
                out = await anyio.to_thread.run_sync(
                    functools.partial(self._engine.generate, prompts, max_new_tokens=new_tokens)
                )
                self.batches += 1
                for r, tokens in zip(batch, out):
                    r.tokens = tokens
                    r.done.set()

    def close(self) -> None:
        self._send.close()


def _reward(tokens: torch.Tensor, prompt_len: int) -> float:
    """A toy reward: how many generated tokens are even."""
    return float((tokens[prompt_len:] % 2 == 0).sum())


def _train(trainer: ReferenceTrainer, lc: Lifecycle, rollouts: torch.Tensor, rewards: torch.Tensor, prompt_len: int) -> float:
    """The training step, behind the same consensus guard as the lifecycle's collectives."""
    lc.agree_on("train", trainer.train_collectives())
    return trainer.train_step(rollouts, rewards - rewards.mean(), prompt_len=prompt_len)


async def rl_loop(cfg: LoopConfig, *, rank: int = 0) -> dict[str, Any]:
    """Run ``cfg.steps`` RL steps on this rank; return a summary."""
    model = ModelConfig()
    saver = CpuMemorySaver()  # trainer and engine share one "device", as on a GPU
    trainer = ReferenceTrainer(config=TrainerConfig(model=model), saver=saver)
    engine = ReferenceEngine(config=EngineConfig(model=model, max_batch=cfg.max_batch), saver=saver)
    lc = Lifecycle(
        trainer=trainer,
        engine=engine,
        config=LifecycleConfig(
            guard=GuardConfig(timeout_s=cfg.guard_timeout_s),
            verify=VerifyConfig(cycles=None),  # every cycle bit-exact
            trace_dir=Path(cfg.trace_dir) if cfg.trace_dir else None,
        ),
    )
    alc = AsyncLifecycle(lc)
    server = EngineServer(engine, alc, max_batch=cfg.max_batch)
    say = (lambda msg: print(f"[rank {rank}] {msg}", flush=True)) if cfg.log else (lambda msg: None)
    gaps: list[float] = []
    changes: list[str] = []
    steps: list[dict[str, Any]] = []

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await anyio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def monitor(stream: StateChanges) -> None:
        with stream:
            async for change in stream:
                took = f" in {change.result.duration_s * 1e3:.1f} ms" if change.result else ""
                changes.append(f"{change.source.value}->{change.dest.value}")
                say(
                    f"{change.trigger.value if change.trigger else 'recover'}: "
                    f"{change.source.value} -> {change.dest.value}{took}"
                )

    async def rollout(i: int, prompt: torch.Tensor, out: dict[str, list[Any]], scores: anyio.abc.TaskGroup) -> None:
        tokens = await server.generate(prompt)
        out["tokens"][i] = tokens
        scores.start_soon(score, i, tokens, out)

    async def score(i: int, tokens: torch.Tensor, out: dict[str, list[Any]]) -> None:
        await anyio.sleep(cfg.reward_latency_s)  # a reward model call
        out["rewards"][i] = _reward(tokens, cfg.prompt_len)

    with lc:
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            tg.start_soon(monitor, alc.changes())  # subscribed now, before the first change
            tg.start_soon(functools.partial(server.serve, new_tokens=cfg.new_tokens))
            await alc.start()
            for step in range(1, cfg.steps + 1):
                gen = torch.Generator().manual_seed(1000 * step + rank)
                prompts = torch.randint(0, model.vocab, (cfg.requests, cfg.prompt_len), generator=gen)
                out: dict[str, list[Any]] = {"tokens": [None] * cfg.requests, "rewards": [None] * cfg.requests}
                t0 = time.perf_counter()
                # `scores` outlives the window: rewards still being scored when the last
                # rollout is in overlap the way back to TRAINING.
                async with anyio.create_task_group() as scores:  # noqa: SIM117
                    async with alc.rollout() as window:
                        async with anyio.create_task_group() as requests:
                            for i in range(cfg.requests):
                                requests.start_soon(rollout, i, prompts[i], out, scores)
                rollouts = torch.stack(out["tokens"])
                rewards = torch.tensor(out["rewards"], dtype=torch.float32)
                loss = await anyio.to_thread.run_sync(
                    functools.partial(_train, trainer, lc, rollouts, rewards, cfg.prompt_len)
                )
                steps.append(
                    {
                        "step": step,
                        "epoch": window.epoch,
                        "reward": float(rewards.mean()),
                        "loss": loss,
                        "seconds": time.perf_counter() - t0,
                    }
                )
                say(
                    f"step {step}: epoch {window.epoch}, {cfg.requests} rollouts, "
                    f"mean reward {float(rewards.mean()):.2f}, loss {loss:.4f}"
                )
            server.close()
            tg.cancel_scope.cancel()
    worst = max(gaps) if gaps else None
    say(f"worst event-loop stall {worst * 1e3:.1f} ms over {len(gaps)} ticks" if worst else "no ticks")
    return {
        "rank": rank,
        "backend": cfg.backend,
        "steps": steps,
        "state": lc.state.value,
        "epoch": lc.epoch,
        "batches": server.batches,
        "changes": changes,
        "worst_stall_s": worst,
        "ticks": len(gaps),
    }


def _rank_main(ctx: RankContext) -> dict[str, Any]:
    cfg = LoopConfig(**ctx.kwargs)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    return anyio.run(lambda: rl_loop(cfg, rank=ctx.rank), backend=cfg.backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16, help="generation requests per step")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--trace-dir", default=None, help="write rank-<r>.jsonl traces here")
    parser.add_argument("--json", action="store_true", help="print one JSON summary instead of the log")
    args = parser.parse_args(argv)
    cfg = LoopConfig(
        steps=args.steps, requests=args.requests, backend=args.backend, trace_dir=args.trace_dir, log=not args.json
    )
    if args.ranks == 1:
        results = [anyio.run(lambda: rl_loop(cfg), backend=cfg.backend)]
    else:
        kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        outcomes = run_ranks(_rank_main, args.ranks, timeout_s=60 + 30 * args.steps, kwargs=kwargs)
        failed = [o for o in outcomes if not o.ok]
        for o in failed:
            print(
                f"rank {o.rank} failed (exit {o.exitcode}): {o.error.type + ': ' + o.error.message if o.error else 'killed'}",
                file=sys.stderr,
            )
        if failed:
            return 1
        results = [o.result for o in outcomes]
    ok = all(r["state"] == State.TRAINING.value and len(r["steps"]) == args.steps for r in results)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps({"ok": ok, "ranks": results}) + b"\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
