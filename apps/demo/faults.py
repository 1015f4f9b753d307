"""The injected faults: the reference trainer that diverges, crashes or corrupts on cue, and the hang.

A fault is armed for one RL step at a time (``DemoTrainer.armed``); each
breaks the rank in the place the brief names:

- ``diverge``: the rank believes a param is frozen (outside its buffers), so
  its planned tensor set and collectives differ -> ``RankDivergenceError``;
- ``hang``: the rank stops before its guard -> the others time out naming it;
- ``crash``: the rank SIGKILLs itself inside ``param_sync`` (``restore`` under
  backup) -> the others lose it, in the all-gather or at their next guard;
- ``corrupt``: a bit flips in the rank's master shard before its restore ->
  ``VerificationError``, traced back to the shard's owner;
- ``stall``: the rank stops inside its train step, after the train guard
  passed, while the others wait in its first collective -> only the process
  group's timeout ends their wait (``DemoConfig.pg_timeout_s``);
- ``undeclared``: the rank's ``param_sync`` (``restore`` under backup) also
  starts an all-reduce its plan does not declare, on a group of the demo's
  own that no peer joins -> ``UndeclaredCollectiveError`` from the plan
  audit; with the audit off, the rank waits for it in its train step while
  the others wait for it in theirs, until the process group's timeout
  (replay ``--flight-recorder`` names both sides);
- ``leak``: from that step on, the rank keeps one more host buffer of
  ``LEAK_BYTES`` alive each step (pinned where CUDA is), written so its pages
  are resident, in a plain list: no tag, no driver accounting, as a user's
  code leaks -> the live drift check warns naming the rank and the figure
  that grew (the RSS; torch's pinned bytes too on CUDA), and replay reports
  the leak (docs/memory-drift.md). The run needs ``DriftConfig().cycles_to_judge``
  steps and the leak 3 steps after its first to be judged; the demo says so
  when it is shorter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["DIVERGE_PARAM", "LEAK_BYTES", "demo_trainer_cls", "drift_unjudged", "hang_forever"]

#: What a ``diverge`` rank wrongly believes is frozen (outside its buffers).
DIVERGE_PARAM = "pos.weight"
#: What a ``leak`` rank keeps alive per step: the issue's smallest leak, ``DriftConfig()``'s ``abs_bytes``.
LEAK_BYTES = 64 << 20


def steps_to_judge_leak(step: int, sustain_cycles: int, cycles_to_judge: int) -> int:
    """The fewest demo steps for a ``leak`` injected at ``step`` to be judged by the sustained-growth rule.

    A step's leaked buffer is kept in its train step, the step's last phase, so
    the snapshots see it from cycle ``step + 1`` on; the rule needs
    ``sustain_cycles`` rises after the cycle before the leak, and a run of
    ``cycles_to_judge`` cycles at least (warm-up, baseline, rises).
    """
    return max(step + sustain_cycles, cycles_to_judge)


def drift_unjudged(steps: int, injections: Iterable[Any]) -> tuple[str | None, bool]:
    """(why the run is too short to judge drift, or None; whether an injected ``leak`` went unjudged)."""
    from miles_fsm.config import DriftConfig

    config = DriftConfig()  # the demo's (rank.py)
    leaks = [i for i in injections if i.kind == "leak"]
    need = max([config.cycles_to_judge]
               + [steps_to_judge_leak(i.step, config.sustain_cycles, config.cycles_to_judge) for i in leaks])  # fmt: skip
    if steps >= need:
        return None, False
    what = "the injected leak" if leaks else "memory drift"
    return (f"{what} was not judged: {steps} steps; sustained growth is judged after {config.warmup_cycles} warm-up "
            f"cycles, a baseline and {config.sustain_cycles} rises, so this run needs --steps {need}"), bool(leaks)  # fmt: skip


def hang_forever() -> None:
    threading.Event().wait()


@functools.cache
def demo_trainer_cls() -> type:
    """``ReferenceTrainer`` plus the demo's faults (imported on first use: it imports torch)."""
    from miles_fsm.apps.demo.trainer import DemoTrainer

    return DemoTrainer
