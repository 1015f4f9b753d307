"""The consensus guard: every rank agrees on a transition, and on its collectives, before any runs.

``consensus`` holds the guard (one small gloo all-reduce on the fast path,
the store for who never came); ``disagreement`` explains a divergence from
every rank's intent. Whom to suspect is ``miles_fsm.blame``, shared with replay.
"""

from miles_fsm.guard.consensus import Guard, roll_call

__all__ = ["Guard", "roll_call"]
