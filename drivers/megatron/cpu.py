"""Real megatron-core on CPU with gloo: an explicit, version-checked opt-in for tests and demos.

megatron-core assumes CUDA in a few places. ``enable()`` patches four of
them so that its DDP, distributed optimizer and GPT run on CPU:

1. ``torch.cuda.current_device`` returns the cpu device (DDP allocates its
   buffers there);
2. ``device="cuda"`` arguments become cpu, and ``Tensor.cuda()`` is a no-op
   (literals in ``optimizer/optimizer.py``, ``transformer/utils.py``,
   ``optimizer/clip_grads.py``);
3. ``Tensor.type()`` reports CUDA type names (``distrib_optimizer.py`` and
   ``clip_grads.py`` check them);
4. the CUDA RNG calls go to the CPU generator (``torch.cuda``'s and
   ``megatron.core.tensor_parallel.random``'s).

This is test- and demo-grade, and it is **process-wide**: 1 and 4 replace
module attributes for every thread, and 2 and 3 are a ``TorchFunctionMode``
pushed for the rest of the process's life on the thread that called
``enable()`` (torch keeps function modes per thread: build and train
megatron on that thread; the lifecycle's own steps need no patch). Nothing
can be undone, so run it in a process of its own (a rank of
``miles_fsm.launch.local.run_ranks``). Importing this module patches nothing;
``enable()`` does, once, logs that it did, and returns what it did.

It refuses, before touching anything:

- a megatron-core outside the range the patches were checked against
  (``UnsupportedVersionError``, naming the version found);
- a process where CUDA is available, unless ``force=True``
  (``CudaAvailableError``): patch 1 alone breaks every CUDA use.

``build_cpu_gpt_trainer`` is what ``miles-fsm demo --trainer megatron``
needs: the patches, a ``CpuMemorySaver``, a tiny GPT (``drivers/megatron/gpt.py``)
and its ``MegatronTrainer``, in one call.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from miles_fsm.drivers.errors import CudaAvailableError, MissingDependencyError, UnsupportedVersionError
from miles_fsm.states import Strategy

if TYPE_CHECKING:
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.gpt import GptConfig, GptTrainer

__all__ = ["PATCHES", "SUPPORTED", "CpuPatches", "build_cpu_gpt_trainer", "enable", "enabled", "supported"]

#: The megatron-core releases the patches were checked against (0.16.1, the newest for Python 3.11).
SUPPORTED = "0.16.x"
_SUPPORTED_MINOR = (0, 16)
_NEEDED_FOR = "miles_fsm.drivers.megatron.cpu.enable() (megatron-core on CPU)"

#: What ``enable()`` changes, in words.
PATCHES = (
    "torch.cuda.current_device() returns the cpu device",
    "device='cuda' arguments become cpu and Tensor.cuda() is a no-op (a TorchFunctionMode on the calling thread)",
    "Tensor.type() reports torch.cuda.* type names (same mode)",
    "torch.cuda and megatron.core.tensor_parallel.random RNG state calls use the CPU generator",
)

_CPU = torch.device("cpu")
_log = logging.getLogger("miles_fsm.drivers.megatron.cpu")
_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuPatches:
    """What ``enable()`` did: the version it checked, the patches, and the thread holding the mode."""

    megatron_core: str
    patches: tuple[str, ...]
    thread: str
    forced: bool


_ENABLED: CpuPatches | None = None


def supported(version: str) -> bool:
    """Whether ``version`` of megatron-core is in the checked range (``SUPPORTED``)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) == _SUPPORTED_MINOR


def enabled() -> CpuPatches | None:
    """What ``enable()`` did in this process, or None if it was not called."""
    return _ENABLED


def enable(*, force: bool = False) -> CpuPatches:
    """Patch megatron-core and torch to run on CPU in this process; idempotent (see the module doc).

    Raises ``MissingDependencyError`` without megatron-core,
    ``UnsupportedVersionError`` outside ``SUPPORTED``, and
    ``CudaAvailableError`` when CUDA is available and ``force`` is false.
    A later call returns the first call's ``CpuPatches`` and changes nothing.
    """
    global _ENABLED
    with _lock:
        if _ENABLED is not None:
            return _ENABLED
        version = _installed_version()
        if not supported(version):
            raise UnsupportedVersionError(
                package="megatron-core", found=version, supported=SUPPORTED, needed_for=_NEEDED_FOR
            )
        if torch.cuda.is_available() and not force:
            raise CudaAvailableError(devices=torch.cuda.device_count(), needed_for=_NEEDED_FOR)
        _apply()
        _ENABLED = CpuPatches(
            megatron_core=version, patches=PATCHES, thread=threading.current_thread().name, forced=force
        )
    _log.warning(
        "miles-fsm: megatron-core %s now runs on CPU in this process (test/demo grade, process-wide, "
        "cannot be undone): %s",
        version,
        "; ".join(PATCHES),
    )
    return _ENABLED


def _installed_version() -> str:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError as exc:
        raise MissingDependencyError(package="megatron-core", extra="megatron", needed_for=_NEEDED_FOR) from exc


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Patches 2 and 3: megatron's hard-coded ``cuda`` devices and type-name checks, answered on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _apply() -> None:
    # These replace torch's functions with ones of other signatures, on purpose (test-only patches), so
    # they go through setattr rather than assignments a type checker would refuse.
    patches: dict[str, Callable[..., Any]] = {
        "current_device": lambda: _CPU,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }
    for name, fn in patches.items():
        setattr(torch.cuda, name, fn)
    _CudaToCpu().__enter__()  # never exited: the mode stays for the process's life
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns at import that Apex/TransformerEngine are absent
        from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # megatron checks it for some overlap settings; on CPU there is one stream either way.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Expected on CPU and not actionable: no Apex/TE, and megatron 0.16 calls the collectives
    # torch 2.13 renamed. Only these messages, only from here on.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine).*", category=UserWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


def build_cpu_gpt_trainer(
    *,
    strategy: Strategy | str = Strategy.REMATERIALIZE,
    gpt: GptConfig | None = None,
    saver: CpuMemorySaver | None = None,
    force: bool = False,
    **settings: Any,
) -> GptTrainer:
    """``enable()``, then a tiny bf16 GPT under DDP + distributed optimizer, and its trainer driver.

    Needs the default process group (gloo), like any megatron model; each
    rank calls it with the same arguments. ``gpt`` is a ``GptConfig``
    (default: 2 layers, hidden 64), ``saver`` a ``CpuMemorySaver`` (a new one
    by default) under which the DDP buffers and, from the first train step
    on, the optimizer state are allocated. ``settings`` go to
    ``MegatronDriverConfig.from_megatron`` (``ci=``, ``extra_params=``, ...).
    Returns a ``GptTrainer``: a ``MegatronTrainer`` with ``train_step`` and
    ``train_collectives``.
    """
    enable(force=force)
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.megatron.gpt import GptConfig, GptTrainer

    return GptTrainer.build(
        gpt=gpt or GptConfig(),
        saver=saver if saver is not None else CpuMemorySaver(),
        strategy=strategy,
        **settings,
    )
