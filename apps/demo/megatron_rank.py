"""One rank of ``miles-fsm demo --trainer megatron``: real megatron-core on CPU gloo, through the lifecycle.

A tiny GPT under megatron-core's DDP and distributed optimizer
(``miles_fsm.drivers.megatron.cpu``, the shipped CPU opt-in), its DDP buffers
and optimizer state in a ``CpuMemorySaver``'s tags, every cycle verified
bit-exact. There is no engine: megatron's weights do not fit the reference
engine's model, so the push is left out and PAUSED is the engine's window.
Fault injection stays with the reference trainer (``config.problems()`` says so).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from miles_fsm.apps.demo.timing import PhaseTimer
from miles_fsm.launch.local import RankContext

__all__ = ["megatron_rank_main"]


def megatron_rank_main(ctx: RankContext) -> dict[str, Any]:
    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.cpu import build_cpu_gpt_trainer
    from miles_fsm.states import State, Strategy
    from miles_fsm.states.lifecycle import Lifecycle

    kw = ctx.kwargs
    saver = CpuMemorySaver()
    trainer = build_cpu_gpt_trainer(strategy=Strategy(kw["mode"]), saver=saver)
    lc = Lifecycle(
        trainer=trainer,
        config=LifecycleConfig(
            guard=GuardConfig(timeout_s=kw["guard_timeout_s"]),
            verify=VerifyConfig(cycles=None),
            trace_dir=kw["trace_dir"],
            run_id=kw["run_id"],
        ),
        trace_meta={"demo": {"steps": kw["steps"], "trainer": "megatron"}},
    )
    held: dict[str, int] = {}
    verified: list[int] = []

    timed = PhaseTimer(saver=saver, epoch=lambda: lc.epoch, host_bytes=lambda: trainer.host_bytes() + saver.host_bytes())

    with lc:
        timed("start", lc.start)
        param_bytes = sum(t.numel() * t.element_size() for t in trainer.tensors().values())
        for step in range(1, kw["steps"] + 1):
            for trigger in lc.definition.path(State.TRAINING, State.PAUSED) or ():
                timed(trigger.value, partial(lc.fire, trigger))
            held = {"actor": trainer.host_bytes("actor"), "ref": trainer.host_bytes("ref"),
                    "saver_backups": saver.host_bytes(),
                    "bf16_params": param_bytes}  # fmt: skip
            for trigger in lc.definition.path(State.PAUSED, State.TRAINING) or ():
                timed(trigger.value, partial(lc.fire, trigger))
            verified.append(lc.epoch)

            def train(step: int = step) -> float:
                lc.agree_on("train", trainer.train_collectives())
                return trainer.train_step(step=step)

            timed("train", train)
    return {"rows": timed.rows, "verified": verified, "held": held, "weights": len(trainer.tensors())}
