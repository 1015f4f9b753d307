"""Helpers for tests of code that embeds a lifecycle: run whole cycles the way the table says.

They drive any lifecycle that exposes ``cycle`` (its triggers from its home
state back to it) and ``fire``, so the order of a cycle is never written
out again in a test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["run_cycles"]


def run_cycles(lc: Any, cycles: int = 1, *, at: Mapping[Any, Callable[[], object]] | None = None) -> list[Any]:
    """Fire ``cycles`` whole cycles of ``lc``; return every ``TransitionResult`` in order.

    ``at`` maps a state to a callable run each time the lifecycle reaches it
    inside a cycle (say, generation while the engine owns the GPU). An error
    stops the run where it happened and propagates, with the lifecycle left
    as that error left it.
    """
    hooks = dict(at or {})
    results = []
    for _ in range(cycles):
        for trigger in lc.cycle:
            result = lc.fire(trigger)
            results.append(result)
            hook = hooks.get(result.dest)
            if hook is not None:
                hook()
    return results
