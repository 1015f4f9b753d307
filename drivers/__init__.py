"""Bindings of the lifecycle to real systems, and the protocols they implement.

The pure-torch reference stack is exported here. The megatron-core,
torch_memory_saver and SGLang drivers import optional dependencies, so import
them from their modules: ``miles_fsm.drivers.megatron``, ``.tms``, ``.sglang``.
"""

from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
from miles_fsm.drivers.protocols import EngineDriver, StepReport, TrainerDriver
from miles_fsm.drivers.reference import ReferenceTrainer
from miles_fsm.drivers.reference_engine import ReferenceEngine

__all__ = [
    "CpuMemorySaver",
    "EngineDriver",
    "MemorySaver",
    "ReferenceEngine",
    "ReferenceTrainer",
    "StepReport",
    "TrainerDriver",
]
