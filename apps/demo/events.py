"""The demo's own trace events, written beside the lifecycle's (``miles_fsm.trace.schema``).

They live here, not in the engine's schema: the engine never writes them and
replay reads them only generically (a record with a ``culprits`` list is a
located fault), so naming them is the app's business.
"""

from __future__ import annotations

__all__ = ["DEMO_FAILED", "DEMO_STEP"]

#: One RL step finished and verified on this rank: ``step``, ``loss``.
DEMO_STEP = "demo_step"
#: The rank stopped: ``where``, ``error``, ``message`` and ``culprits`` (null: not located).
DEMO_FAILED = "demo_failed"
