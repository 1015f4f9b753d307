"""SGLang's memory tags, and the rules a release or resume must keep so the engine lives.

A double release, a resume of a tag that is not released, and a release while
requests run each kill SGLang's scheduler (run on an H200, ``docs/sglang.md``).
``EngineMemory`` is the driver's ledger of what it released on each engine,
where it paused generation, and whose weights came back as garbage; it
refuses with ``MemoryTagError`` before anything is sent. The ledger is apart
from the weight push because it is the one part of the driver that must hold
across failures: after a partial failure it touches only the engines that
still need the call, so ``Lifecycle.recover`` never double-releases.

With a memory probe (``SGLangConfig.memory_probe``), every release and resume
is measured: the device bytes in use just before and after the call. The
trainer is idle while its driver waits on the engine, so the difference is
the engine's: what a release freed, what a resume took back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from miles_fsm.drivers.errors import EngineRequestError
from miles_fsm.drivers.sglang.protocol import SGLangTransport
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError

__all__ = ["MEMORY_TAGS", "RESUME_ORDER", "EngineMemory", "check_tag", "device_memory_probe"]

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
#: SGLang resumes in this order; the driver does too when given several tags.
RESUME_ORDER = ("cuda_graph", "weights", "kv_cache")


def device_memory_probe(device: int) -> Callable[[], int]:
    """A ``memory_probe`` for an engine on this host's CUDA ``device``: its bytes in use (total - free),
    read from the driver (device-wide: it counts every process on the GPU)."""

    def in_use() -> int:
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)

    return in_use


def check_tag(tag: str) -> None:
    if tag not in MEMORY_TAGS:
        raise ConfigError([f"unknown SGLang memory tag {tag!r}; the tags are {', '.join(MEMORY_TAGS)}"], "memory tag")


class EngineMemory:
    """Per engine: the tags released, whether this driver paused generation, and stale weights.

    With ``pause`` set, generation is paused (``abort``) on an engine before
    its first release and continued once every tag is back on it.
    """

    def __init__(self, transports: Sequence[SGLangTransport], *, pause: bool,
                 probe: Callable[[], int] | None = None) -> None:  # fmt: skip
        self._transports = tuple(transports)
        self._pause = pause
        self._probe = probe
        #: The measured calls, newest last (the last 512): engine, tag, op, bytes in use before and after, seconds.
        self.log: deque[dict[str, Any]] = deque(maxlen=512)
        #: Per tag (``engine/tag`` with several engines): the bytes its last resume took back.
        self.taken: dict[str, int] = {}
        self.released: dict[str, set[str]] = {t.name: set() for t in transports}
        self.paused: set[str] = set()
        #: Engines whose weights were resumed and not pushed since.
        self.stale: set[str] = set()

    def all_released(self) -> set[str]:
        return set().union(*self.released.values())

    def release(self, tag: str) -> None:
        """Release ``tag`` on every engine that holds it (pausing generation there first)."""
        check_tag(tag)
        targets = [t for t in self._transports if tag not in self.released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="pause", paused=self.all_released())
        for t in targets:
            if self._pause and t.name not in self.paused:
                # "abort" whatever pause_mode says: retracted or in-place requests
                # keep the scheduler busy, and a busy release kills it.
                t.pause_generation("abort")
                self.paused.add(t.name)
            self._call(t, tag, release=True)

    def resume(self, tag: str) -> None:
        """Resume ``tag`` on every engine that released it; continue generation where all tags are back."""
        check_tag(tag)
        targets = [t for t in self._transports if tag in self.released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="resume", paused=self.all_released())
        for t in targets:
            self._call(t, tag, release=False)
            self.continue_if_resident(t)

    def release_all(self, tags: Sequence[str] | None = None) -> None:
        for tag in tags or MEMORY_TAGS:
            self.release(tag)

    def resume_all(self, tags: Sequence[str] | None = None) -> None:
        wanted = set(tags) if tags else self.all_released()
        for tag in wanted:
            check_tag(tag)
        for tag in RESUME_ORDER:
            if tag in wanted:
                self.resume(tag)

    def continue_if_resident(self, t: SGLangTransport) -> None:
        """Continue generation on ``t`` if this driver paused it and every tag is back."""
        if t.name in self.paused and not self.released[t.name]:
            t.continue_generation()
            self.paused.discard(t.name)

    def _call(self, t: SGLangTransport, tag: str, *, release: bool) -> None:
        before = self._probe() if self._probe is not None else None
        t0 = time.perf_counter()
        try:
            (t.release if release else t.resume)([tag])
        except EngineRequestError as exc:
            if exc.status is None:
                # No answer: the call may have happened. Assume the tag is
                # released either way, the side that cannot kill the engine: a
                # later resume of an active tag fails cleanly, a second
                # release of a released tag kills the scheduler.
                self.released[t.name].add(tag)
                exc.add_note(
                    f"miles-fsm: {t.name} is assumed to have {tag!r} released now (no answer); a resume is safe"
                )
            raise
        if before is not None and self._probe is not None:
            self._measured(t.name, tag, release, before, self._probe(), time.perf_counter() - t0)
        if release:
            self.released[t.name].add(tag)
        else:
            self.released[t.name].discard(tag)
            if tag == "weights":
                self.stale.add(t.name)

    def _measured(self, engine: str, tag: str, release: bool, before: int, after: int, seconds: float) -> None:
        self.log.append({"engine": engine, "tag": tag, "op": "release" if release else "resume",
                         "in_use_before": before, "in_use_after": after, "s": seconds})  # fmt: skip
        if not release:
            self.taken[tag if len(self._transports) == 1 else f"{engine}/{tag}"] = after - before
