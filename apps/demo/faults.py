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
  ``LEAK_BYTES`` alive each step (pinned where CUDA is), accounted under the
  host tag ``LEAK_TAG`` -> the live drift check warns naming the rank and the
  tag, and replay reports the leak (docs/memory-drift.md).
"""

from __future__ import annotations

import functools
import threading

__all__ = ["DIVERGE_PARAM", "LEAK_BYTES", "LEAK_TAG", "demo_trainer_cls", "hang_forever"]

#: What a ``diverge`` rank wrongly believes is frozen (outside its buffers).
DIVERGE_PARAM = "pos.weight"
#: Where a ``leak`` rank's buffers are accounted: a stale weight copy kept each step, never dropped.
LEAK_TAG = "old_actor"
#: What a ``leak`` rank keeps alive per step: twice the demo's drift tolerance (``rank.py`` sets
#: ``DriftConfig(abs_bytes=LEAK_BYTES // 2)``), so one step's leak is already past it.
LEAK_BYTES = 16 << 20


def hang_forever() -> None:
    threading.Event().wait()


@functools.cache
def demo_trainer_cls() -> type:
    """``ReferenceTrainer`` plus the demo's faults (imported on first use: it imports torch)."""
    from miles_fsm.apps.demo.trainer import DemoTrainer

    return DemoTrainer
