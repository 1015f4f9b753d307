"""What the SGLang driver asks of one engine: the transport protocol, and what it reports.

``SGLangTransport`` is the seam between the driver's rules
(``miles_fsm.drivers.sglang.driver``) and the two ways of reaching an engine
(``http``, ``offline``). It lives apart from both so that each
transport, and the driver, depends on the protocol alone. An engine's
abilities differ by version (weight-update sessions arrived in 0.5.21; 0.5.17
has none), so each transport can ``probe()`` them once into an
``EngineCapabilities``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["EngineCapabilities", "EngineChecksums", "SGLangTransport"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineCapabilities:
    """What one engine supports, probed once (``SGLangTransport.probe``).

    ``sessions``: ``/begin_weight_update`` and ``/end_weight_update`` exist
    (SGLang 0.5.21 and later; slime and NeMo-RL also run engines without them).
    ``weights_checker``: ``/weights_checker`` answers ``action=checksum`` with
    the engine's own per-rank checksums of the weights it serves.
    ``version``: the SGLang version the engine reports, or None if it says none.
    """

    version: str | None
    sessions: bool
    weights_checker: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineChecksums:
    """The engine's checksums of the weights it serves: one mapping per TP rank.

    Names and hashes are SGLang's (its own fused layout, e.g. ``qkv_proj``,
    and its own 64-bit tensor hash), not the trainer's; ``per_rank`` is each
    rank's digest over its mapping, ``per_engine`` the engine's over those.
    """

    ranks: tuple[Mapping[str, str], ...]
    per_rank: tuple[str, ...]
    per_engine: str | None




class SGLangTransport(Protocol):
    """One engine's protocol; raises only ``EngineRequestError`` / ``EngineSessionError``."""

    @property
    def name(self) -> str: ...

    @property
    def sets_version(self) -> bool:
        """Whether the engine stores the version the push carries (HTTP can; the Engine cannot)."""
        ...

    def probe(self) -> EngineCapabilities:
        """Ask the engine what it supports; the driver calls this once per engine."""
        ...

    def release(self, tags: Sequence[str]) -> None: ...
    def resume(self, tags: Sequence[str]) -> None: ...
    def begin_update(self) -> None: ...
    def end_update(self, *, abort: bool = False) -> None:
        """End the session; ``abort=True`` when the update was cancelled or failed."""
        ...

    def checksums(self) -> EngineChecksums: ...
    def update_from_tensor(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        tp_size: int,
        load_format: str | None,
        flush_cache: bool,
        weight_version: str | None,
    ) -> None: ...
    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...
    def update_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush_cache: bool,
        load_format: str | None,
        weight_version: str | None,
    ) -> None: ...
    def destroy_group(self, group_name: str) -> None: ...
    def set_version(self, version: str) -> None: ...
    def version(self) -> str | None: ...
    def flush_cache(self) -> None: ...
    def pause_generation(self, mode: str) -> None: ...
    def continue_generation(self) -> None: ...
    def close(self) -> None: ...

