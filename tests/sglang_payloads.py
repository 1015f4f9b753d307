"""The test server's side of a push: SGLang's payload format, unpickled as SGLang does, and its hash.

Apart from the rules (``sglang_rules``) because this is about bytes, not
state: an allow-list unpickler like 0.5.17's ``SafeUnpickler``, the
``flattened_bucket`` layout, and SGLang's tensor hash, which the driver's
tests also use to compute the checksums they expect.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions, to unpickle shared tensors)

__all__ = ["BlockedClassError", "named_from", "rank_digest", "tensor_checksum", "unpickle"]

#: Module prefixes SGLang's unpickler accepts in a pushed payload (0.5.17, SafeUnpickler);
#: a payload that needs anything else is refused there, so it is refused here too.
ALLOWED_PICKLE_MODULES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "sglang.srt.weight_sync.tensor_bucket.",
)



class BlockedClassError(pickle.UnpicklingError):
    """The payload needs a class SGLang's unpickler refuses."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not any((module + ".").startswith(p) for p in ALLOWED_PICKLE_MODULES):
            raise BlockedClassError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def unpickle(payload: str | bytes) -> Any:
    raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    return _AllowListUnpickler(io.BytesIO(raw)).load()


def named_from(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one rank's payload: a list of (name, tensor), or a flattened bucket."""
    if load_format != "flattened_bucket":
        return list(obj)
    flat = obj["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]


def tensor_checksum(t: torch.Tensor) -> str:
    """SGLang's tensor hash on its CPU path: the first 8 bytes of SHA256 of the bytes, as 16 hex digits."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).digest()[:8].hex()


def rank_digest(checksums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()

