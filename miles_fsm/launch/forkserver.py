"""Preloaded by the ranks' forkserver only: that process outlives a SIGTERM or SIGHUP to the process group.

``timeout``, Slurm, ``docker stop`` and a closed terminal signal every
process of the group at once. The forkserver would die of it at once, and
with it every rank (each dies with its parent, the forkserver:
``stopping.set_parent_death_signal``), before the launcher could tell them
why they stop; their traces would end mid-run. So the forkserver ignores
both. It still ends with the launcher: its pipe from the launcher closes.
Each rank sets both back to their default as it starts (``block_stop_signals``).

Importing this module anywhere else does nothing: it acts only while
``multiprocessing.forkserver.main`` preloads it.
"""

from __future__ import annotations

import signal
import sys

__all__: list[str] = []


def _preloaded_by_forkserver() -> bool:
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _preloaded_by_forkserver():
    for _signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_signal, signal.SIG_IGN)
