"""Bindings of the lifecycle to real systems.

The pure-torch reference stack is the default. Importing this package is
light: every name resolves on first use (PEP 562), so a tool that needs one
driver never imports the others, or torch, or an optional dependency. The
megatron-core, torch_memory_saver and SGLang drivers import optional
dependencies: import them from their modules (``miles_fsm.drivers.megatron.driver``,
``.tms``, ``.sglang``).
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

_LAZY = {
    "CpuMemorySaver": "miles_fsm.drivers.cpu_memory",
    "MemorySaver": "miles_fsm.drivers.cpu_memory",
    "ReferenceEngine": "miles_fsm.drivers.reference.engine",
    "ReferenceTrainer": "miles_fsm.drivers.reference.trainer",
}

# Exactly _LAZY's names (tests/test_public_api.py checks it): a literal, for type checkers and doc tools.
__all__ = [
    "CpuMemorySaver",
    "MemorySaver",
    "ReferenceEngine",
    "ReferenceTrainer",
]

if TYPE_CHECKING:
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
    from miles_fsm.drivers.reference.engine import ReferenceEngine
    from miles_fsm.drivers.reference.trainer import ReferenceTrainer

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
