"""Which memory tags are released, per side, and the refusal of misuse.

torch_memory_saver calls ``exit(1)`` on a pause of paused memory or a resume
of active memory, and SGLang's scheduler dies on a double release. A
``MemoryLedger`` stands in front of such a driver and refuses those requests
with ``MemoryTagError`` before anything is sent. The lifecycle keeps one per
side; drivers used standalone can embed one too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from miles_fsm.states.errors import MemoryTagError

__all__ = ["MemoryLedger"]


class MemoryLedger:
    """Tracks released tags of one side and calls its pause/resume functions."""

    def __init__(self, side: str, *, pause: Callable[[str], object], resume: Callable[[str], object]) -> None:
        self.side = side
        self._pause = pause
        self._resume = resume
        self._paused: set[str] = set()

    @property
    def paused(self) -> frozenset[str]:
        return frozenset(self._paused)

    def check(self, op: str, tags: Iterable[str]) -> None:
        """Raise ``MemoryTagError`` if any tag cannot take ``op`` ("pause"/"resume") now."""
        pausing = op == "pause"
        for tag in tags:
            if (tag in self._paused) == pausing:
                raise MemoryTagError(side=self.side, tag=tag, op=op, paused=self._paused)

    def pause(self, tags: Iterable[str]) -> None:
        """Pause each tag in order; refuses the whole request if any tag is paused."""
        tags = tuple(tags)
        self.check("pause", tags)
        for tag in tags:
            self._pause(tag)
            self._paused.add(tag)

    def resume(self, tags: Iterable[str]) -> None:
        """Resume each tag in order; refuses the whole request if any tag is active."""
        tags = tuple(tags)
        self.check("resume", tags)
        for tag in tags:
            self._resume(tag)
            self._paused.discard(tag)
