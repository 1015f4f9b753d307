"""Bindings of the lifecycle to real systems.

The pure-torch reference stack is the default. Importing this package is
light: every name resolves on first use (PEP 562), so a tool that needs one
driver never imports the others, or torch, or an optional dependency. The
megatron-core, torch_memory_saver and SGLang drivers import optional
dependencies: import them from their modules (``miles_fsm.drivers.megatron``,
``.tms``, ``.sglang``).
"""

from typing import TYPE_CHECKING

_LAZY = {
    "CpuMemorySaver": "miles_fsm.drivers.cpu_memory",
    "MemorySaver": "miles_fsm.drivers.cpu_memory",
    "ReferenceEngine": "miles_fsm.drivers.reference_engine",
    "ReferenceTrainer": "miles_fsm.drivers.reference",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
    from miles_fsm.drivers.reference import ReferenceTrainer
    from miles_fsm.drivers.reference_engine import ReferenceEngine


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_fsm.drivers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
