"""An offline ``sglang.Engine`` in this process, as a transport.

``EngineTransport`` calls the Engine's methods directly; whatever its
scheduler raises becomes ``EngineRequestError``. The Engine cannot store a
weight version and has no checksum call, which the driver reads from
``sets_version`` and the probe. sglang is imported only by ``launch``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, MissingDependencyError
from miles_fsm.drivers.sglang.payload import serialize_named_tensors
from miles_fsm.drivers.sglang.protocol import EngineCapabilities, EngineChecksums

if TYPE_CHECKING:
    import sglang
    import torch

__all__ = ["EngineTransport"]


def _result_ok(result: Any) -> tuple[bool, str]:
    """The Engine returns ``(success, message)``, an object with ``.success``, a dict, or None."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return result[0], str(result[1])
    if isinstance(result, Mapping) and "success" in result:
        return bool(result["success"]), str(result.get("message", ""))
    success = getattr(result, "success", None)
    if isinstance(success, bool):
        return success, str(getattr(result, "message", ""))
    return True, ""


class EngineTransport:
    """An offline ``sglang.Engine`` in this process; its methods block.

    The Engine cannot set a weight version (stack-facts), so the driver keeps
    the version of the last completed push for it (``sets_version`` False).
    Sessions are used when the Engine has ``begin_weight_update``; the Engine
    (0.5.17) has no checksum call, so pushes to it are not checksum-verified.
    """

    sets_version = False

    def __init__(self, engine: sglang.Engine, *, name: str = "engine0") -> None:
        self._engine = engine
        self._name = name

    @classmethod
    def launch(cls, *, name: str = "engine0", **server_args: Any) -> EngineTransport:
        """Start ``sglang.Engine(**server_args)``; sglang is imported only here."""
        try:
            import sglang
        except ImportError as exc:
            raise MissingDependencyError(package="sglang", extra=None, needed_for="the offline SGLang Engine") from exc
        return cls(sglang.Engine(**server_args), name=name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def engine(self) -> sglang.Engine:
        return self._engine

    def _call(self, op: str, fn: Callable[[], Any], *, session: bool = False) -> Any:
        try:
            result = fn()
        # The Engine raises whatever its scheduler raised (KeyError for an
        # unreleased tag, RuntimeError, ...); each becomes the one error the
        # driver documents, with the original kept as the cause.
        except Exception as exc:
            raise EngineRequestError(
                engine=self.name, op=op, status=None, message=f"{type(exc).__name__}: {exc}"
            ) from exc
        ok, message = _result_ok(result)
        if not ok:
            if session:
                raise EngineSessionError(engine=self.name, op=op, detail=message or "the engine refused")
            raise EngineRequestError(engine=self.name, op=op, status=None, message=message)
        return result

    def probe(self) -> EngineCapabilities:
        version = None
        if callable(getattr(self._engine, "get_server_info", None)):
            info = self._call("get_server_info", self._engine.get_server_info)
            value = info.get("version") if isinstance(info, Mapping) else None
            version = None if value is None else str(value)
        return EngineCapabilities(
            version=version,
            sessions=callable(getattr(self._engine, "begin_weight_update", None)),
            weights_checker=False,
        )

    def release(self, tags: Sequence[str]) -> None:
        self._call(
            f"release_memory_occupation({','.join(tags)})", lambda: self._engine.release_memory_occupation(list(tags))
        )

    def resume(self, tags: Sequence[str]) -> None:
        self._call(
            f"resume_memory_occupation({','.join(tags)})", lambda: self._engine.resume_memory_occupation(list(tags))
        )

    def begin_update(self) -> None:
        self._call("begin_weight_update", lambda: self._engine.begin_weight_update(selector="all"), session=True)

    def end_update(self, *, abort: bool = False) -> None:
        if abort:
            self._call("end_weight_update(abort)", lambda: self._engine.end_weight_update(abort=True), session=True)
        else:
            self._call("end_weight_update", lambda: self._engine.end_weight_update(), session=True)

    def checksums(self) -> EngineChecksums:
        raise EngineRequestError(
            engine=self.name, op="weights_checker(checksum)", status=None, message="the offline Engine has no checksum call"
        )

    def update_from_tensor(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        tp_size: int,
        load_format: str | None,
        flush_cache: bool,
        weight_version: str | None,
    ) -> None:
        # The Engine serializes one payload per TP rank itself, except a
        # flattened bucket, which it takes already serialized, one per rank.
        payload: Any = list(named)
        if load_format == "flattened_bucket":
            payload = [serialize_named_tensors(named, load_format) for _ in range(tp_size)]
        self._call(
            "update_weights_from_tensor",
            lambda: self._engine.update_weights_from_tensor(payload, load_format=load_format, flush_cache=flush_cache),
        )

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        self._call(
            "init_weights_update_group",
            lambda: self._engine.init_weights_update_group(
                master_address, master_port, rank_offset, world_size, group_name, backend=backend
            ),
        )

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
    ) -> None:
        self._call(
            "update_weights_from_distributed",
            lambda: self._engine.update_weights_from_distributed(
                list(names),
                list(dtypes),
                [list(s) for s in shapes],
                group_name,
                flush_cache=flush_cache,
                load_format=load_format,
            ),
        )

    def destroy_group(self, group_name: str) -> None:
        self._call("destroy_weights_update_group", lambda: self._engine.destroy_weights_update_group(group_name))

    def set_version(self, version: str) -> None:
        raise EngineRequestError(
            engine=self.name, op="update_weight_version", status=None, message="the offline Engine cannot set it"
        )

    def version(self) -> str | None:
        info = self._call("get_model_info", self._engine.get_model_info)
        value = info.get("weight_version") if isinstance(info, Mapping) else None
        return None if value is None else str(value)

    def flush_cache(self) -> None:
        self._call("flush_cache", self._engine.flush_cache)

    def pause_generation(self, mode: str) -> None:
        # Offline generate() calls block the caller, so nothing runs during a
        # push from the same thread; engines that expose the call get it.
        if hasattr(self._engine, "pause_generation"):
            self._call(f"pause_generation({mode})", lambda: self._engine.pause_generation(mode=mode))

    def continue_generation(self) -> None:
        if hasattr(self._engine, "continue_generation"):
            self._call("continue_generation", self._engine.continue_generation)

    def close(self) -> None:
        """The Engine belongs to the caller: ``engine.shutdown()`` is theirs to call."""
