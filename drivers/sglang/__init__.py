"""The SGLang driver: an engine driver over SGLang's HTTP server or its offline Engine.

``driver`` holds ``SGLangEngineDriver``; ``config`` its frozen configs;
``protocol`` the transport protocol, with ``http`` and ``offline`` as its
two transports; ``payload`` the weight-update format; ``push`` the update
itself; ``memory`` the engine's memory tags; ``checksums`` the engine's
weight checksums. Names resolve on first use: importing the package imports
neither SGLang nor httpx.
"""

from typing import TYPE_CHECKING

from miles_fsm.lazy import lazy_exports

_LAZY = {
    "DistributedConfig": "miles_fsm.drivers.sglang.config",
    "EngineCapabilities": "miles_fsm.drivers.sglang.protocol",
    "EngineChecksums": "miles_fsm.drivers.sglang.protocol",
    "EngineTransport": "miles_fsm.drivers.sglang.offline",
    "HttpConfig": "miles_fsm.drivers.sglang.http",
    "HttpTransport": "miles_fsm.drivers.sglang.http",
    "SGLangConfig": "miles_fsm.drivers.sglang.config",
    "SGLangEngineDriver": "miles_fsm.drivers.sglang.driver",
    "SGLangTransport": "miles_fsm.drivers.sglang.protocol",
    "device_memory_probe": "miles_fsm.drivers.sglang.memory",
}

__all__ = [
    "DistributedConfig",
    "EngineCapabilities",
    "EngineChecksums",
    "EngineTransport",
    "HttpConfig",
    "HttpTransport",
    "SGLangConfig",
    "SGLangEngineDriver",
    "SGLangTransport",
    "device_memory_probe",
]

if TYPE_CHECKING:
    from miles_fsm.drivers.sglang.config import DistributedConfig, SGLangConfig
    from miles_fsm.drivers.sglang.driver import SGLangEngineDriver
    from miles_fsm.drivers.sglang.http import HttpConfig, HttpTransport
    from miles_fsm.drivers.sglang.memory import device_memory_probe
    from miles_fsm.drivers.sglang.offline import EngineTransport
    from miles_fsm.drivers.sglang.protocol import EngineCapabilities, EngineChecksums, SGLangTransport

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
