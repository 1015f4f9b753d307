"""The pure-torch reference trainer and engine: the embedded default, which runs anywhere on CPU.

``trainer`` holds ``ReferenceTrainer`` (fp32 masters, bf16 params, Adam, a
DDP-like param buffer); ``engine`` the ``ReferenceEngine`` that generates
with the pushed weights; ``model`` the small transformer both run.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

_LAZY = {
    "AdamConfig": "miles_fsm.drivers.reference.trainer",
    "EngineConfig": "miles_fsm.drivers.reference.engine",
    "ModelConfig": "miles_fsm.drivers.reference.model",
    "ReferenceEngine": "miles_fsm.drivers.reference.engine",
    "ReferenceTrainer": "miles_fsm.drivers.reference.trainer",
    "TrainerConfig": "miles_fsm.drivers.reference.trainer",
}

__all__ = [
    "AdamConfig",
    "EngineConfig",
    "ModelConfig",
    "ReferenceEngine",
    "ReferenceTrainer",
    "TrainerConfig",
]

if TYPE_CHECKING:
    from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
    from miles_fsm.drivers.reference.model import ModelConfig
    from miles_fsm.drivers.reference.trainer import AdamConfig, ReferenceTrainer, TrainerConfig

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
