"""SGLang transports: the HTTP server API and the offline ``sglang.Engine``.

A transport only speaks SGLang's protocol: one request per call, errors turned
into ``EngineRequestError`` (or ``EngineSessionError`` for a refused session).
What an engine supports differs by version (weight-update sessions arrived in
0.5.21; 0.5.17 has none), so each transport can ``probe()`` it once into an
``EngineCapabilities``. The rules (which tag may be released, sessions around
pushes, versions, checksums) live in ``SGLangEngineDriver``
(``miles_fsm.drivers.sglang``).
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, MissingDependencyError
from miles_fsm.errors import ConfigError

if TYPE_CHECKING:
    import torch

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


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpConfig:
    """Timeouts and retries of the HTTP transport.

    Only idempotent reads (``GET /model_info``) are retried: a release or a
    push that timed out may have happened, and sending it again could be the
    double release that kills the scheduler.
    """

    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    read_retries: int = 2
    retry_backoff_s: float = 0.1
    api_key: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.timeout_s > 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.connect_timeout_s > 0:
            problems.append(f"connect_timeout_s must be > 0, got {self.connect_timeout_s!r}")
        if self.read_retries < 0:
            problems.append(f"read_retries must be >= 0, got {self.read_retries!r}")
        if self.retry_backoff_s < 0:
            problems.append(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s!r}")
        if problems:
            raise ConfigError(problems, "HttpConfig")


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
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

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


def parse_checksums(engine: str, body: Any) -> EngineChecksums:
    """``/weights_checker`` ``action=checksum``: ``{"ranks": [{"checksums", "per_gpu_checksum"}], ...}``."""
    ranks = body.get("ranks") if isinstance(body, Mapping) else None
    if not isinstance(ranks, list) or not ranks:
        raise EngineRequestError(
            engine=engine, op="weights_checker(checksum)", status=200, message=f"no per-rank checksums in {body!r:.300}"
        )
    try:
        return EngineChecksums(
            ranks=tuple({str(k): str(v) for k, v in r["checksums"].items()} for r in ranks),
            per_rank=tuple(str(r["per_gpu_checksum"]) for r in ranks),
            per_engine=None if body.get("per_engine_checksum") is None else str(body["per_engine_checksum"]),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise EngineRequestError(
            engine=engine, op="weights_checker(checksum)", status=200, message=f"unexpected rank entry: {exc!r}"
        ) from exc


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


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise MissingDependencyError(
            package="httpx", extra="sglang-http", needed_for="the SGLang HTTP transport"
        ) from exc
    return httpx


def _error_message(response: Any) -> str:
    """SGLang's error text: ``{"error": {"message"}}``, ``{"message"}``, or the body."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


class HttpTransport:
    """One SGLang server, over HTTP (httpx, the ``sglang-http`` extra)."""

    sets_version = True

    def __init__(self, url: str, *, config: HttpConfig | None = None) -> None:
        httpx = _import_httpx()
        self._httpx = httpx
        self._url = url.rstrip("/")
        self._config = config or HttpConfig()
        headers = {"Authorization": f"Bearer {self._config.api_key}"} if self._config.api_key else None
        self._client = httpx.Client(
            base_url=self._url,
            timeout=httpx.Timeout(self._config.timeout_s, connect=self._config.connect_timeout_s),
            headers=headers,
        )

    @property
    def name(self) -> str:
        return self._url

    def _no_response(self, op: str, exc: BaseException) -> EngineRequestError:
        return EngineRequestError(
            engine=self.name,
            op=op,
            status=None,
            message=f"{type(exc).__name__}: {exc}; the engine may have died, or the request may still "
            "have taken effect",
        )

    def _post(self, op: str, path: str, body: Mapping[str, Any] | None = None, *, session: bool = False) -> Any:
        try:
            response = self._client.post(path, json=dict(body or {}))
        except self._httpx.HTTPError as exc:
            raise self._no_response(op, exc) from exc
        return self._checked(op, response, session=session)

    def _get(self, op: str, path: str) -> Any:
        attempts = self._config.read_retries + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                response = self._client.get(path)
            except self._httpx.TransportError as exc:
                if last:
                    raise self._no_response(op, exc) from exc
            else:
                if response.status_code not in (502, 503, 504) or last:
                    return self._checked(op, response)
            time.sleep(self._config.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _checked(self, op: str, response: Any, *, session: bool = False) -> Any:
        if response.status_code >= 400:
            raise EngineRequestError(
                engine=self.name, op=op, status=response.status_code, message=_error_message(response)
            )
        try:
            data = response.json()
        except ValueError:
            return response.text
        if isinstance(data, dict) and data.get("success") is False:
            message = str(data.get("message", ""))
            if session:
                raise EngineSessionError(engine=self.name, op=op, detail=message or "the engine refused")
            raise EngineRequestError(engine=self.name, op=op, status=response.status_code, message=message)
        return data

    def probe(self) -> EngineCapabilities:
        """The version from ``/server_info`` (``/get_server_info`` before it); routes by their status.

        A route is probed with ``OPTIONS``, which no SGLang route accepts:
        FastAPI answers 405 for a route that exists and 404 for one that does
        not, and nothing runs. So the probe opens no session and computes no
        checksum.
        """
        return EngineCapabilities(
            version=self._server_version(),
            sessions=self._has_route("/begin_weight_update"),
            weights_checker=self._has_route("/weights_checker"),
        )

    def _server_version(self) -> str | None:
        for path in ("/server_info", "/get_server_info"):
            try:
                info = self._get("server_info", path)
            except EngineRequestError as exc:
                if exc.status == 404:
                    continue
                raise
            value = info.get("version") if isinstance(info, Mapping) else None
            return None if value is None else str(value)
        return None

    def _has_route(self, path: str) -> bool:
        try:
            response = self._client.request("OPTIONS", path)
        except self._httpx.HTTPError as exc:
            raise self._no_response(f"probe {path}", exc) from exc
        if response.status_code == 404:
            return False
        if response.status_code == 405:
            return True
        raise EngineRequestError(
            engine=self.name,
            op=f"probe {path}",
            status=response.status_code,
            message="expected 404 (no such route) or 405 (route exists, OPTIONS not allowed): "
            + _error_message(response),
        )

    def release(self, tags: Sequence[str]) -> None:
        self._post(f"release_memory_occupation({','.join(tags)})", "/release_memory_occupation", {"tags": list(tags)})

    def resume(self, tags: Sequence[str]) -> None:
        self._post(f"resume_memory_occupation({','.join(tags)})", "/resume_memory_occupation", {"tags": list(tags)})

    def begin_update(self) -> None:
        self._post("begin_weight_update", "/begin_weight_update", {"selector": "all"}, session=True)

    def end_update(self, *, abort: bool = False) -> None:
        op = "end_weight_update(abort)" if abort else "end_weight_update"
        self._post(op, "/end_weight_update", {"abort": True} if abort else {}, session=True)

    def checksums(self) -> EngineChecksums:
        body = self._post("weights_checker(checksum)", "/weights_checker", {"action": "checksum"})
        return parse_checksums(self.name, body)

    def update_from_tensor(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        *,
        tp_size: int,
        load_format: str | None,
        flush_cache: bool,
        weight_version: str | None,
    ) -> None:
        # One payload per TP rank; each is serialized on its own because a CPU
        # tensor's shared-memory handle can be opened only once.
        body = {
            "serialized_named_tensors": [serialize_named_tensors(named, load_format) for _ in range(tp_size)],
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        self._post("update_weights_from_tensor", "/update_weights_from_tensor", body)

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._post("init_weights_update_group", "/init_weights_update_group", body)

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
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "load_format": load_format,
            "weight_version": weight_version,
        }
        self._post("update_weights_from_distributed", "/update_weights_from_distributed", body)

    def destroy_group(self, group_name: str) -> None:
        self._post("destroy_weights_update_group", "/destroy_weights_update_group", {"group_name": group_name})

    def set_version(self, version: str) -> None:
        self._post(
            "update_weight_version", "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )

    def version(self) -> str | None:
        info = self._get("model_info", "/model_info")
        if not isinstance(info, dict):
            raise EngineRequestError(
                engine=self.name, op="model_info", status=200, message=f"not a JSON object: {info!r}"
            )
        value = info.get("weight_version")
        return None if value is None else str(value)

    def flush_cache(self) -> None:
        self._post("flush_cache", "/flush_cache")

    def pause_generation(self, mode: str) -> None:
        self._post(f"pause_generation({mode})", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._post("continue_generation", "/continue_generation", {})

    def close(self) -> None:
        self._client.close()


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

    def __init__(self, engine: Any, *, name: str = "engine0") -> None:
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
    def engine(self) -> Any:
        return self._engine

    def _call(self, op: str, fn: Callable[[], Any], *, session: bool = False) -> Any:
        try:
            result = fn()
        # The Engine raises whatever its scheduler raised (KeyError for an
        # unreleased tag, RuntimeError, ...); each becomes the one error the
        # driver documents, with the original kept as the cause.
        except Exception as exc:  # noqa: BLE001
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
