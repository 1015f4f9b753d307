"""A process-wide count of torch module registrations: a cheap ``structure_version`` for nn.Module trainers.

torch calls its global registration hooks whenever any module gains (or
replaces) a parameter, a buffer or a submodule, assignments included. A
count of those calls changes whenever a ``tensor_set()`` built from
``named_parameters()`` / ``named_buffers()`` could, at no cost per
transition. It is process-wide on purpose: over-counting (another model
changed) only costs one walk, under-counting would hide a change.

It does not see ``del module.weight`` or a ``param.data = ...`` swap to
another shape: torch calls no hook for either. A driver that does those
bumps its own count too; the lifecycle's re-walk on verified cycles is the
backstop (``StructureVersionError``).
"""

from __future__ import annotations

import itertools
import threading

__all__ = ["registrations"]

_count = itertools.count(1)
_now = 0
_installed = False
_lock = threading.Lock()


def _tick(*_: object) -> None:
    global _now
    _now = next(_count)  # returns None: torch keeps the registered object as it is


def registrations() -> int:
    """Module registrations seen in this process since the hooks went in (installs them on first use)."""
    global _installed
    if not _installed:
        with _lock:
            if not _installed:
                from torch.nn.modules import module

                module.register_module_parameter_registration_hook(_tick)
                module.register_module_buffer_registration_hook(_tick)
                module.register_module_module_registration_hook(_tick)
                _installed = True
    return _now
