"""One row per timed phase of a demo rank: how long, what it moved, peak device and host bytes after."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Times phases of one rank; ``host_bytes()`` says what the trainer and the saver hold on the host."""

    def __init__(self, *, saver: Any, epoch: Callable[[], int], host_bytes: Callable[[], int]) -> None:
        self._saver = saver
        self._epoch = epoch
        self._host_bytes = host_bytes
        self.rows: list[dict[str, Any]] = []

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self._saver.reset_peak()
        t0 = time.perf_counter()
        out = fn()
        self.rows.append({
            "name": name,
            "epoch": self._epoch(),
            "duration_s": time.perf_counter() - t0,
            "bytes_moved": getattr(out, "bytes_moved", None),
            "peak_bytes": self._saver.peak_bytes(),
            "host_bytes": self._host_bytes(),
        })  # fmt: skip
        return out
