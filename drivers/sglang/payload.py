"""Named tensors as SGLang takes them: buckets, ``flattened_bucket``, by-value CPU tensors.

SGLang's ``MultiprocessingSerializer`` format is the one piece of the push
both transports share (the HTTP body carries it; the offline Engine takes it
for a flattened bucket), and its subtleties (CUDA IPC for CUDA tensors,
copies by value for CPU ones, the engine's unpickling allow-list) are about
serialization, not about either transport. torch is imported on first use.
"""

from __future__ import annotations

import base64
import importlib
import io
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import MissingDependencyError
from miles_fsm.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["buckets", "flattened_bucket", "flattened_bucket_class", "serialize_named_tensors"]



def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]], load_format: str | None = None) -> str:
    """SGLang's ``MultiprocessingSerializer`` format: ForkingPickler bytes, base64 for JSON.

    CUDA tensors travel as CUDA IPC handles (the server must share the GPU).
    CPU tensors travel by value, inside the payload: torch's own sharing of a
    CPU tensor passes a file descriptor that the engine fetches from this
    process over a connection keyed with this process's ``authkey``, which
    an engine started elsewhere does not have; and it would move the
    trainer's storage into shared memory in place.

    The engine unpickles with an allow-list (SGLang 0.5.17: torch,
    ``multiprocessing.resource_sharer``/``reduction``, SGLang's own modules,
    builtins...), so only tensors, names and SGLang's bucket metadata go in.
    """
    # Importing it registers torch's reductions with ForkingPickler, which the payload is pickled by.
    importlib.import_module("torch.multiprocessing")

    payload: Any
    if load_format == "flattened_bucket":
        payload = flattened_bucket(named)
    else:
        payload = [(name, t.detach()) for name, t in named]
    buf = io.BytesIO()
    _PayloadPickler(buf).dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _payload_pickler() -> type:
    import functools
    from multiprocessing.reduction import ForkingPickler

    import torch

    class FlatBytes:
        """A CPU tensor's bytes, rebuilt by ``torch.frombuffer`` (a name SGLang's unpickler allows)."""

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class PayloadPickler(ForkingPickler):
        """ForkingPickler (CUDA IPC for CUDA tensors) that writes CPU tensors by value."""

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                t = obj.detach().contiguous()
                if t.numel() == 0:
                    return functools.partial(torch.empty, dtype=t.dtype), (tuple(t.shape),)
                return torch.reshape, (FlatBytes(t), tuple(t.shape))
            if isinstance(obj, FlatBytes):
                # Through a copy: exporting the trainer's own storage to numpy
                # would make it unresizable, and a memory saver frees by resizing.
                data = bytearray(obj.t.reshape(-1).view(torch.uint8).clone().numpy().tobytes())
                return functools.partial(torch.frombuffer, dtype=obj.t.dtype), (data,)
            return NotImplemented

    return PayloadPickler


class _PayloadPickler:
    """Builds the pickler class on first use, so importing this module does not import torch."""

    _cls: type | None = None

    def __new__(cls, buf: io.BytesIO) -> Any:
        if cls._cls is None:
            cls._cls = _payload_pickler()
        return cls._cls(buf)


def flattened_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``flattened_bucket`` payload: one flat uint8 tensor and SGLang's metadata for each tensor.

    The metadata objects must be SGLang's own class (the engine's unpickler
    allows ``sglang.srt.weight_sync.tensor_bucket`` and refuses others), so
    sglang must be importable here. Flattening copies the bucket once, on the
    tensors' device: the trainer's own storage is never shared.
    """
    bucket_class = flattened_bucket_class()
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ConfigError(
            [f"a flattened bucket needs its tensors on one device, got {sorted(map(str, devices))}"],
            "load_format='flattened_bucket'",
        )
    bucket = bucket_class(named_tensors=[(n, t.detach().contiguous()) for n, t in named])
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def flattened_bucket_class() -> Any:
    """SGLang's ``FlattenedTensorBucket``; ``MissingDependencyError`` when sglang is not importable."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as exc:
        raise MissingDependencyError(
            package="sglang", extra=None, needed_for="load_format='flattened_bucket' (SGLang's bucket metadata)"
        ) from exc
    return FlattenedTensorBucket



def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes``; a larger tensor is a bucket of its own."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket

