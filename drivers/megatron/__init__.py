"""The megatron-core driver: DDP with the distributed optimizer under the lifecycle.

``driver`` holds ``MegatronTrainer`` (backup, restore, rematerialize by
``cast_main_to_params`` and param sync); ``config`` its frozen config;
``buffers`` and ``optimizer`` what it pauses, backs up and rebuilds;
``gpt`` a tiny GPT to test it with; ``cpu`` the test-only patches that run
megatron-core on CPU with gloo; ``llama`` a Llama-shaped GPT and its shape,
and ``convert`` its weights to and from HF ``LlamaForCausalLM``. Names resolve on first use: importing the
package imports neither megatron-core nor torch.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

_LAZY = {
    "GptConfig": "miles_fsm.drivers.megatron.gpt",
    "GptTrainer": "miles_fsm.drivers.megatron.gpt",
    "LlamaShape": "miles_fsm.drivers.megatron.llama",
    "MegatronDriverConfig": "miles_fsm.drivers.megatron.config",
    "MegatronTrainer": "miles_fsm.drivers.megatron.driver",
    "Mistake": "miles_fsm.drivers.megatron.convert",
    "TagMemory": "miles_fsm.drivers.megatron.config",
    "build_llama_gpt": "miles_fsm.drivers.megatron.llama",
    "build_tiny_gpt": "miles_fsm.drivers.megatron.gpt",
    "hf_to_megatron": "miles_fsm.drivers.megatron.convert",
    "iter_hf_weights": "miles_fsm.drivers.megatron.convert",
    "load_hf_weights": "miles_fsm.drivers.megatron.convert",
    "megatron_to_hf": "miles_fsm.drivers.megatron.convert",
}

__all__ = [
    "GptConfig",
    "GptTrainer",
    "LlamaShape",
    "MegatronDriverConfig",
    "MegatronTrainer",
    "Mistake",
    "TagMemory",
    "build_llama_gpt",
    "build_tiny_gpt",
    "hf_to_megatron",
    "iter_hf_weights",
    "load_hf_weights",
    "megatron_to_hf",
]

if TYPE_CHECKING:
    from miles_fsm.drivers.megatron.config import MegatronDriverConfig, TagMemory
    from miles_fsm.drivers.megatron.convert import (
        Mistake,
        hf_to_megatron,
        iter_hf_weights,
        load_hf_weights,
        megatron_to_hf,
    )
    from miles_fsm.drivers.megatron.driver import MegatronTrainer
    from miles_fsm.drivers.megatron.gpt import GptConfig, GptTrainer, build_tiny_gpt
    from miles_fsm.drivers.megatron.llama import LlamaShape, build_llama_gpt

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
