"""The SGLang transports and what they exchange, under the name they had before the split.

The protocol (``sglang_protocol``), the HTTP transport (``sglang_http``), the
offline Engine transport (``sglang_offline``), the payload format
(``sglang_payload``) and the checksum reader (``sglang_checksums``) were one
module; code that imports them from here keeps working.
"""

from miles_fsm.drivers.sglang_checksums import parse_checksums
from miles_fsm.drivers.sglang_http import HttpConfig, HttpTransport
from miles_fsm.drivers.sglang_offline import EngineTransport
from miles_fsm.drivers.sglang_payload import (
    buckets,
    flattened_bucket,
    flattened_bucket_class,
    serialize_named_tensors,
)
from miles_fsm.drivers.sglang_protocol import EngineCapabilities, EngineChecksums, SGLangTransport

__all__ = [
    "EngineCapabilities",
    "EngineChecksums",
    "EngineTransport",
    "HttpConfig",
    "HttpTransport",
    "SGLangTransport",
    "buckets",
    "flattened_bucket",
    "flattened_bucket_class",
    "parse_checksums",
    "serialize_named_tensors",
]
