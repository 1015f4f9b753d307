"""How the SGLang driver pushes weights and treats generation: ``SGLangConfig``, ``DistributedConfig``.

The configs check themselves when built (``ConfigError`` listing every
problem), so a combination SGLang would fail on mid-push, such as a flush
after a pause that keeps requests pending, is refused before any engine is
touched. They hold no behaviour, which is why they sit apart from the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from miles_fsm.drivers.sglang.checksums import ExpectedChecksums
from miles_fsm.errors import ConfigError

__all__ = ["PAUSE_MODES", "DistributedConfig", "SGLangConfig"]

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedConfig:
    """The broadcast group of ``update_weights_from_distributed``.

    The trainer is rank 0; engine ``i`` joins at ``1 + i * tp_size``.
    ``master_port=0`` picks a free port on ``master_address`` for each push.
    """

    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "miles_fsm_weight_update"
    backend: str = "nccl"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.master_port < 65536:
            problems.append(f"master_port must be in [0, 65535], got {self.master_port!r}")
        if not self.group_name:
            problems.append("group_name must not be empty")
        if not self.timeout_s > 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if problems:
            raise ConfigError(problems, "DistributedConfig")


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangConfig:
    """How the driver pushes weights and treats generation around a push."""

    #: "tensor": update_weights_from_tensor (serialized tensors, CUDA IPC on a GPU);
    #: "distributed": update_weights_from_distributed (a broadcast group).
    method: str = "tensor"
    #: Tensors are pushed in buckets of at most this many bytes (a larger tensor goes alone).
    bucket_bytes: int = 512 << 20
    #: Tensor-parallel ranks per engine: one serialized payload per rank.
    tp_size: int = 1
    #: None (the model's own loader), "direct", a custom loader's name, or "flattened_bucket"
    #: (one flat tensor per bucket; needs sglang importable here, for its metadata class).
    load_format: str | None = None
    #: Flush the radix cache once after the session ends (the KV of old weights is stale).
    flush_cache: bool = True
    #: ``pause_generation`` mode around a push, or None to leave generation alone.
    #: "abort" is the one that leaves nothing pending, which a flush needs. Unless None,
    #: the driver also pauses with "abort" before releasing memory (a release with
    #: requests in flight kills the scheduler) and continues once every tag is back.
    pause_mode: str | None = "abort"
    #: Read the engine's own checksums after each push, where it has ``/weights_checker``.
    verify_checksums: bool = True
    #: The checksums each TP rank must report after a push of these weights, in SGLang's
    #: names and hash. Without it, engines that received the same push must agree.
    expected_checksums: ExpectedChecksums | None = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    #: Reads the device bytes in use where the engines run (``device_memory_probe(index)`` when the
    #: engine shares this process's GPU). Read before and after each release and resume, so the
    #: driver can say what each tag frees and takes back (``memory_log``, ``device_bytes_by_tag``),
    #: and the drift check can judge it cycle by cycle. None: the engine's memory is not measured.
    memory_probe: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.memory_probe is not None and not callable(self.memory_probe):
            problems.append(f"memory_probe must be a callable returning device bytes in use, got {self.memory_probe!r}")
        if self.method not in ("tensor", "distributed"):
            problems.append(f"method must be 'tensor' or 'distributed', got {self.method!r}")
        if self.bucket_bytes < 1:
            problems.append(f"bucket_bytes must be >= 1, got {self.bucket_bytes!r}")
        if self.tp_size < 1:
            problems.append(f"tp_size must be >= 1, got {self.tp_size!r}")
        if self.load_format == "flattened_bucket" and self.method == "distributed":
            problems.append("load_format='flattened_bucket' is supported with method='tensor' only")
        if self.pause_mode is not None and self.pause_mode not in PAUSE_MODES:
            problems.append(f"pause_mode must be one of {PAUSE_MODES} or None, got {self.pause_mode!r}")
        if self.pause_mode in ("in_place", "retract") and self.flush_cache:
            # Both keep requests pending (running, or queued again), and SGLang
            # does not flush while requests are pending: the push would fail
            # whenever generation was busy.
            problems.append(
                f"pause_mode={self.pause_mode!r} keeps requests pending, so it cannot be combined with "
                "flush_cache=True; use pause_mode='abort', or flush_cache=False"
            )
        if problems:
            raise ConfigError(problems, "SGLangConfig")


