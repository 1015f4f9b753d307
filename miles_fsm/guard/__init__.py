"""The consensus guard: every rank agrees on a transition, and on its collectives, before any runs.

``consensus`` holds the guard (one small gloo all-reduce on the fast path,
the store for who never came); ``publisher`` writes a waiting rank's
arrival to the store off the hot path; ``roll`` (``roll_call``) names the
ranks that never build a guard; ``store`` says which store, and where in it
a guard keeps its keys (from its group's identity); ``disagreement``
explains a divergence from every rank's intent. Whom to suspect is ``miles_fsm.blame``, shared with replay.
"""

from miles_fsm.guard.consensus import Guard
from miles_fsm.guard.publisher import GuardStoreWarning
from miles_fsm.guard.roll import roll_call

__all__ = ["Guard", "GuardStoreWarning", "roll_call"]
