"""torch_memory_saver as a ``MemorySaver``: pausable CUDA memory by tag.

``TmsMemorySaver`` implements the seam of ``drivers/cpu_memory.py`` with the
real library (pip ``torch-memory-saver``, 0.0.10), so a trainer written
against ``CpuMemorySaver`` runs on a GPU unchanged. The library calls
``exit(1)`` on misuse, so every call is checked first and refused with a
Python error, nothing reaching the library:

- pausing a paused tag, resuming an active tag, allocating into a paused tag:
  ``MemoryTagError``;
- a resume the device has too little free memory for: ``ResumeMemoryError``
  (the tracked region bytes are a lower bound of what the resume maps);
- ``hook_mode="preload"`` without the library in ``LD_PRELOAD``, and
  ``expandable_segments:True``: ``ConfigError``, before the library loads.

torch_memory_saver is a process-wide singleton whose hook mode is fixed at
its first use, so the ledger of paused tags is process-wide too: two
``TmsMemorySaver`` objects in one process share it (a second object can never
pause what the first paused). The package is imported on first use only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from miles_fsm.drivers.errors import MissingDependencyError, ResumeMemoryError
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError

__all__ = ["HOOK_MODES", "TmsConfig", "TmsMemorySaver", "TmsRegion", "exit_past_shutdown", "preload_library_path"]

HOOK_MODES = ("preload", "torch")
_BACKENDS = ("pinned", "mmap")


@dataclass(frozen=True, kw_only=True, slots=True)
class TmsConfig:
    """How torch_memory_saver is set up in this process.

    ``hook_mode``: ``"preload"`` (the library's default; the process must start
    with ``LD_PRELOAD`` naming ``preload_library_path()``) or ``"torch"``
    (torch's pluggable allocator; no environment needed).
    ``retain_cpu_backup`` keeps the host copy of backed-up regions between
    cycles: measured on H200, 8.6 GB pause/resume went from 3.0 s / 0.9 s to
    0.16 s / 0.18 s, at the cost of holding that host memory for good.
    """

    hook_mode: str = "preload"
    retain_cpu_backup: bool = False
    cpu_backup_backend: str | None = None
    #: Refuse a resume unless this much device memory stays free beyond the tag's bytes.
    resume_margin_bytes: int = 64 << 20
    #: Wait for queued kernels before a pause: unmapping memory a kernel still reads is a crash.
    synchronize: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.hook_mode not in HOOK_MODES:
            problems.append(f"hook_mode must be one of {HOOK_MODES}, got {self.hook_mode!r}")
        if self.cpu_backup_backend is not None and self.cpu_backup_backend not in _BACKENDS:
            problems.append(f"cpu_backup_backend must be one of {_BACKENDS} or None, got {self.cpu_backup_backend!r}")
        if self.resume_margin_bytes < 0:
            problems.append(f"resume_margin_bytes must be >= 0, got {self.resume_margin_bytes!r}")
        if problems:
            raise ConfigError(problems, "TmsConfig")


@dataclass(slots=True, eq=False)
class TmsRegion:
    """One flat allocation under a tag, made through ``TmsMemorySaver.empty``."""

    tag: str
    tensor: torch.Tensor
    backup: bool

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class _Ledger:
    """The process-wide facts: paused tags, tracked regions, the mode the library started in."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.paused: set[str] = set()
        self.regions: list[TmsRegion] = []
        self.hook_mode: str | None = None
        self.retain_cpu_backup: bool | None = None
        self.backed_up_once: set[str] = set()


_LEDGER = _Ledger()


def preload_library_path(cuda_major: int | None = None) -> Path:
    """The ``*_preload_cu<major>*.so`` of the installed wheel, found without importing it.

    ``LD_PRELOAD`` must name it when the process starts, for ``hook_mode="preload"``.
    """
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None or spec.origin is None:
        raise MissingDependencyError(
            package="torch-memory-saver", extra="tms", needed_for="torch_memory_saver's preload hook"
        )
    if cuda_major is None:
        if not torch.version.cuda:
            raise ConfigError(["this torch build has no CUDA; the preload hook needs one"], "preload_library_path")
        cuda_major = int(torch.version.cuda.split(".", 1)[0])
    package_dir = Path(spec.origin).parent
    stem = f"torch_memory_saver_hook_mode_preload_cu{cuda_major}"
    found = sorted(package_dir.glob(f"{stem}*.so")) or sorted(package_dir.parent.glob(f"{stem}*.so"))
    if len(found) != 1:
        raise ConfigError(
            [f"expected one {stem}*.so next to {package_dir}, found {[str(f) for f in found]}"], "preload_library_path"
        )
    return found[0]


def _environment_problems(config: TmsConfig) -> list[str]:
    problems = []
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        problems.append("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch_memory_saver refuses")
    if config.hook_mode == "preload":
        preloaded = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "torch_memory_saver" in p]
        if len(preloaded) != 1:
            problems.append(
                "hook_mode='preload' needs exactly one torch_memory_saver library in LD_PRELOAD when the process "
                f"starts (found {preloaded}); start it with LD_PRELOAD=$(python -c 'from miles_fsm.drivers.tms "
                "import preload_library_path as p; print(p())'), or use hook_mode='torch'"
            )
    return problems


class TmsMemorySaver:
    """``MemorySaver`` over torch_memory_saver, for one CUDA device.

    ``empty(tag, ...)`` allocates inside ``region(tag)``; ``region`` is also
    public, for code that allocates its own buffers (megatron's DDP). Bytes
    allocated through ``region`` directly are not tracked, so
    ``resident_bytes`` and the resume memory check count ``empty`` only.
    """

    def __init__(
        self,
        *,
        config: TmsConfig | None = None,
        device: torch.device | int | None = None,
        name: str = "torch_memory_saver",
    ) -> None:
        self.config = config or TmsConfig()
        self.name = name
        self._device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self._tms: Any = None

    # ------------------------------------------------------------ library

    def _library(self) -> Any:
        """The singleton, set up on first use; every precondition is checked first."""
        if self._tms is not None:
            return self._tms
        with _LEDGER.lock:
            problems = _environment_problems(self.config)
            if _LEDGER.hook_mode is not None and _LEDGER.hook_mode != self.config.hook_mode:
                problems.append(
                    f"torch_memory_saver already runs with hook_mode={_LEDGER.hook_mode!r} in this process; "
                    f"it cannot switch to {self.config.hook_mode!r}"
                )
            if _LEDGER.retain_cpu_backup not in (None, self.config.retain_cpu_backup):
                problems.append(
                    f"retain_cpu_backup is process-wide and already {_LEDGER.retain_cpu_backup}; "
                    f"this saver asks for {self.config.retain_cpu_backup} (change it with set_retain_cpu_backup)"
                )
            if problems:
                raise ConfigError(problems, "torch_memory_saver setup")
            try:
                from torch_memory_saver import torch_memory_saver as tms
            except ImportError as exc:
                raise MissingDependencyError(
                    package="torch-memory-saver", extra="tms", needed_for="the torch_memory_saver memory driver"
                ) from exc
            if _LEDGER.hook_mode is None:
                if getattr(tms, "_impl", None) is not None:
                    raise ConfigError(
                        [
                            "torch_memory_saver was initialized outside miles-fsm; build TmsMemorySaver before any "
                            "other use of the library, so that its hook mode and paused tags are known"
                        ],
                        "torch_memory_saver setup",
                    )
                tms.hook_mode = self.config.hook_mode
                _LEDGER.hook_mode = self.config.hook_mode
            # Creates the library's state now, not in the middle of a region.
            tms.retain_cpu_backup = self.config.retain_cpu_backup
            _LEDGER.retain_cpu_backup = self.config.retain_cpu_backup
            self._tms = tms
            return tms

    # ------------------------------------------------------------ MemorySaver

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def paused_tags(self) -> frozenset[str]:
        return frozenset(_LEDGER.paused)

    @contextmanager
    def region(self, tag: str, *, backup: bool = False) -> Iterator[None]:
        """Allocations made inside are pausable under ``tag`` (thread-local in the library)."""
        tms = self._library()
        if tag in _LEDGER.paused:
            raise MemoryTagError(side=self.name, tag=tag, op="allocate in", paused=_LEDGER.paused)
        kwargs: dict[str, Any] = {"enable_cpu_backup": backup}
        if backup and self.config.cpu_backup_backend is not None:
            kwargs["cpu_backup_backend"] = self.config.cpu_backup_backend
        with torch.cuda.device(self._device), tms.region(tag, **kwargs):
            yield

    def empty(self, tag: str, numel: int, dtype: torch.dtype, *, backup: bool = False) -> torch.Tensor:
        """One flat, zero-filled, pausable tensor under ``tag``."""
        with self.region(tag, backup=backup):
            tensor = torch.zeros(numel, dtype=dtype, device=self._device)
        with _LEDGER.lock:
            _LEDGER.regions.append(TmsRegion(tag=tag, tensor=tensor, backup=backup))
        return tensor

    def pause(self, tag: str, *, synchronize: bool = True) -> None:
        """Unmap every allocation of ``tag``; backed-up regions keep a host copy.

        The device is synchronized first (``TmsConfig.synchronize``) unless
        ``synchronize=False``: the caller then guarantees that no queued work
        touches the tag, e.g. because it synchronized before queueing copies
        of other memory that may go on during the unmap.
        """
        with _LEDGER.lock:
            if tag in _LEDGER.paused:
                raise MemoryTagError(side=self.name, tag=tag, op="pause", paused=_LEDGER.paused)
            tms = self._library()
            if self.config.synchronize and synchronize:
                torch.cuda.synchronize(self._device)
            tms.pause(tag)
            _LEDGER.paused.add(tag)
            if any(r.tag == tag and r.backup for r in _LEDGER.regions):
                _LEDGER.backed_up_once.add(tag)

    def resume(self, tag: str) -> None:
        """Map ``tag`` back; contents are undefined unless the region was backed up."""
        with _LEDGER.lock:
            if tag not in _LEDGER.paused:
                raise MemoryTagError(side=self.name, tag=tag, op="resume", paused=_LEDGER.paused)
            tms = self._library()
            needed = sum(r.nbytes for r in _LEDGER.regions if r.tag == tag)
            if needed:
                free, _ = torch.cuda.mem_get_info(self._device)
                if free < needed + self.config.resume_margin_bytes:
                    raise ResumeMemoryError(
                        owner=self.name, tag=tag, needed=needed + self.config.resume_margin_bytes, free=free
                    )
            tms.resume(tag)
            _LEDGER.paused.discard(tag)

    def resident_bytes(self, tags: Iterable[str] | None = None) -> int:
        wanted = None if tags is None else set(tags)
        return sum(
            r.nbytes for r in _LEDGER.regions if r.tag not in _LEDGER.paused and (wanted is None or r.tag in wanted)
        )

    def host_bytes(self, tags: Iterable[str] | None = None) -> int:
        """Host bytes of backed-up regions: while paused, or for good with ``retain_cpu_backup``."""
        wanted = None if tags is None else set(tags)
        held = _LEDGER.paused | (_LEDGER.backed_up_once if _LEDGER.retain_cpu_backup else set())
        return sum(
            r.nbytes for r in _LEDGER.regions if r.backup and r.tag in held and (wanted is None or r.tag in wanted)
        )

    def set_retain_cpu_backup(self, value: bool) -> None:
        """Change the process-wide ``retain_cpu_backup`` (the library has one setting per process)."""
        with _LEDGER.lock:
            tms = self._library()
            tms.retain_cpu_backup = value
            _LEDGER.retain_cpu_backup = value
            if not value:
                _LEDGER.backed_up_once.clear()

    @property
    def retain_cpu_backup(self) -> bool:
        return bool(_LEDGER.retain_cpu_backup)

    def regions(self, tag: str | None = None) -> tuple[TmsRegion, ...]:
        return tuple(r for r in _LEDGER.regions if tag is None or r.tag == tag)

    def timed_pause(self, tag: str) -> float:
        """Pause ``tag`` and return the seconds it took, device work included (for benchmarks)."""
        torch.cuda.synchronize(self._device)
        t0 = time.perf_counter()
        self.pause(tag)
        torch.cuda.synchronize(self._device)
        return time.perf_counter() - t0

    def timed_resume(self, tag: str) -> float:
        """Resume ``tag`` and return the seconds it took, device work included (for benchmarks)."""
        torch.cuda.synchronize(self._device)
        t0 = time.perf_counter()
        self.resume(tag)
        torch.cuda.synchronize(self._device)
        return time.perf_counter() - t0


def _reset_for_tests() -> None:
    """Forget the process-wide ledger (unit tests with a mocked library only)."""
    global _LEDGER
    _LEDGER = _Ledger()


def exit_past_shutdown(code: int) -> NoReturn:
    """End the process now with ``code``, its streams flushed, skipping the interpreter's shutdown.

    torch_memory_saver's torch hook exits 1 when the interpreter frees region
    tensors at shutdown ("only support interesting region"), which would
    overrule the exit code of a run that passed. Call it last: nothing after
    it runs, no ``finally`` and no ``atexit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
