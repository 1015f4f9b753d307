"""One rank of the demo: K RL steps of the reference trainer and engine through a ``Lifecycle``.

Runs in a child process started by ``miles_fsm.launch.local.run_ranks``, so it
takes plain data (``DemoConfig.to_kwargs``) and returns plain data: the timed
rows of every phase, the epochs verified, and the host bytes held while
PAUSED. Each step::

    offload -> pause (push weights) -> generate -> rematerialize -> sync
    -> resume (verify) -> train

The train step sits behind the same consensus guard as the lifecycle's
collectives.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from miles_fsm.apps.demo.events import DEMO_FAILED, DEMO_STEP
from miles_fsm.apps.demo.faults import demo_trainer_cls, hang_forever
from miles_fsm.apps.demo.locate import locate, publish_pid
from miles_fsm.apps.demo.timing import PhaseTimer
from miles_fsm.errors import describe
from miles_fsm.launch.local import RankContext
from miles_fsm.states import Strategy

__all__ = ["rank_main"]


def rank_main(ctx: RankContext) -> dict[str, Any]:
    """One rank of the demo; runs in a child process started by ``run_ranks``."""
    return _DemoRank(ctx).run()


class _DemoRank:
    """The demo's drivers and lifecycle on one rank, and where its steps have got to."""

    def __init__(self, ctx: RankContext) -> None:
        import torch

        from miles_fsm.drivers.cpu_memory import CpuMemorySaver
        from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
        from miles_fsm.drivers.reference.trainer import ModelConfig, TrainerConfig
        from miles_fsm.states import State

        kw = self.kw = ctx.kwargs
        rank, world = self.rank, self.world = ctx.rank, ctx.world
        # N ranks share the host's cores; more intra-op threads than that only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        mode = Strategy(kw["mode"])
        self.model = model = ModelConfig(**kw["model"])
        self.arms = {step: kind for kind, r, step in kw["injections"] if r == rank}
        if world > 1:
            publish_pid(rank)

        saver = self.saver = CpuMemorySaver()  # one "device": trainer and engine share it, as they share a GPU
        trainer = self.trainer = demo_trainer_cls()(config=TrainerConfig(model=model, strategy=mode), saver=saver)
        self.engine = ReferenceEngine(config=EngineConfig(model=model, max_batch=kw["batch"]), saver=saver)
        if any(kind == "undeclared" for kind, _, _ in kw["injections"]):  # every rank: making a group is collective
            import torch.distributed as dist

            trainer.side_group = dist.new_group(backend="gloo", group_desc="demo_side")
        lc = self.lc = self._lifecycle()
        # A rank stopped from outside (Ctrl-C, SIGTERM, the linger after a peer failed, or its launcher's
        # death) closes its trace with why, so it reads neither as a run that ended well nor as a crash.
        ctx.on_stopped(lambda error: lc.close(error=error))
        self.held: dict[str, int] = {}
        self.verified: list[int] = []
        self.timed = PhaseTimer(saver=saver, epoch=lambda: lc.epoch,
                                host_bytes=lambda: trainer.backup_host_bytes() + saver.host_bytes())  # fmt: skip
        self.wake = lc.definition.path(State.PAUSED, State.TRAINING) or ()
        self.where = "start"

    def _lifecycle(self) -> Any:
        from miles_fsm.config import DriftConfig, GuardConfig, LifecycleConfig, VerifyConfig
        from miles_fsm.states.lifecycle import Lifecycle

        kw = self.kw
        # The lifecycle builds its guard: a rank that never comes is then named in this rank's trace too.
        return Lifecycle(
            trainer=self.trainer,
            engine=self.engine,
            config=LifecycleConfig(
                guard=GuardConfig(timeout_s=kw["guard_timeout_s"]),
                verify=VerifyConfig(cycles=None, audit=kw.get("audit", True)),
                drift=DriftConfig(),  # the defaults a user gets: the demo's leak is judged as theirs would be
                trace_dir=Path(kw["trace_dir"]),
                run_id=kw["run_id"],
            ),
            trace_meta={"demo": {"steps": kw["steps"],
                                 "injections": [":".join(map(str, i)) for i in kw["injections"]]}},  # fmt: skip
        )

    def run(self) -> dict[str, Any]:
        lc, trainer = self.lc, self.trainer
        with lc:
            try:
                self.timed("start", lc.start)
                for step in range(1, self.kw["steps"] + 1):
                    self._step(step)
            except Exception as exc:  # re-raised below, with the culprit named when the evidence allows
                located = self._failed(exc)
                if located is not None:
                    raise located from exc
                raise
        return {"rows": self.timed.rows, "verified": self.verified, "held": self.held,
                "weights": len(trainer.weights()), "drift": [asdict(f) for f in lc.drift.tracker.findings()],
                "drift_judged": lc.drift.tracker.judged}  # fmt: skip

    def _step(self, step: int) -> None:
        """One RL step, from TRAINING round the cycle and a guarded train step."""
        import torch

        from miles_fsm.states import Trigger

        lc, trainer, saver, kw, timed = self.lc, self.trainer, self.saver, self.kw, self.timed
        trainer.armed = self.arms.get(step)
        hang = hang_forever if trainer.armed == "hang" else None
        self.where = "offload"
        timed("offload", lambda: lc.fire(Trigger.OFFLOAD, before_guard=hang))
        self.where = "pause"
        timed("pause", lc.pause)
        self.held = {
            "actor": trainer.backup_host_bytes("actor"),
            "actor_bf16_params": trainer.host_bf16_param_bytes(),
            "ref": trainer.backup_host_bytes("ref"),
            "saver_backups": saver.host_bytes(),
            "bf16_params": sum(t.numel() * 2 for t in trainer.params.values()),
        }
        self.where = "generate"
        gen = torch.Generator().manual_seed(1000 * step + self.rank)
        prompts = torch.randint(0, self.model.vocab, (kw["batch"], kw["prompt_len"]), generator=gen)
        rollouts = timed("generate", lambda: self.engine.generate(prompts, max_new_tokens=kw["new_tokens"]))
        for trig in self.wake:  # PAUSED back to TRAINING, in the table's order
            self.where = trig.value
            timed(trig.value, partial(lc.fire, trig))
        self.verified.append(lc.epoch)
        self.where = "train"
        loss = timed("train", lambda: guarded_train(lc, trainer, rollouts, kw["prompt_len"]))
        lc.tracer.emit(DEMO_STEP, epoch=lc.epoch, state=lc.state.value, trigger=None, step=step, loss=loss)

    def _failed(self, exc: Exception) -> Exception | None:
        """Publish, dump and trace a failure outside the lifecycle's own; the located fault, if any."""
        from miles_fsm.states import State

        lc, where, guard = self.lc, self.where, self.lc.guard
        if lc.state is not State.FAILED and self.world > 1:  # the lifecycle publishes its own failures
            guard.publish_failure(lc.epoch, where, lc.state.value, f"failed in {where} of",
                                  error=type(exc).__name__)  # fmt: skip
        if lc.state is not State.FAILED:  # the lifecycle dumps its own failures' recorder too
            lc.dump_flight_recorder(trigger=where, epoch=lc.epoch, step=None, error=type(exc).__name__)
        located = locate(exc, rank=self.rank, world=self.world, guard=guard, trainer=self.trainer)
        lc.tracer.emit(
            DEMO_FAILED,
            epoch=lc.epoch,
            state=lc.state.value,
            trigger=None,
            where=where,
            **describe(exc),  # error, message, and fields or transport: replay reads them, never the text
            culprits=list(located.culprits) if located is not None else None,
        )
        return located


def guarded_train(lc: Any, trainer: Any, rollouts: Any, prompt_len: int) -> float:
    """The train step behind the consensus guard: its collectives are agreed on first."""
    lc.agree_on("train", trainer.train_collectives())
    reward = (rollouts[:, prompt_len:] % 2 == 0).float().sum(dim=1)
    return trainer.train_step(rollouts, reward - reward.mean(), prompt_len=prompt_len)
