"""The megatron-core driver: DDP with the distributed optimizer under the lifecycle.

``driver`` holds ``MegatronTrainer`` (backup, restore, rematerialize by
``cast_main_to_params`` and param sync); ``config`` its frozen config;
``buffers`` and ``optimizer`` what it pauses, backs up and rebuilds;
``gpt`` a tiny GPT to test it with; ``cpu`` the test-only patches that run
megatron-core on CPU with gloo. Names resolve on first use: importing the
package imports neither megatron-core nor torch.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

_LAZY = {
    "GptConfig": "miles_fsm.drivers.megatron.gpt",
    "GptTrainer": "miles_fsm.drivers.megatron.gpt",
    "MegatronDriverConfig": "miles_fsm.drivers.megatron.config",
    "MegatronTrainer": "miles_fsm.drivers.megatron.driver",
    "TagMemory": "miles_fsm.drivers.megatron.config",
    "build_tiny_gpt": "miles_fsm.drivers.megatron.gpt",
}

__all__ = [
    "GptConfig",
    "GptTrainer",
    "MegatronDriverConfig",
    "MegatronTrainer",
    "TagMemory",
    "build_tiny_gpt",
]

if TYPE_CHECKING:
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig, TagMemory
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.megatron.gpt import GptConfig, GptTrainer, build_tiny_gpt

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
