"""One SGLang server over HTTP (httpx, the ``sglang-http`` extra).

``HttpTransport`` speaks the server API: one request per call, every failure
turned into ``EngineRequestError`` (``EngineSessionError`` for a refused
session), and only idempotent reads retried. Its probe reads routes by the
status FastAPI answers, so it runs nothing on the engine. It is separate from
the offline Engine transport because the two share the protocol and the
payload format, not a line of their code.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, MissingDependencyError
from miles_fsm.drivers.sglang.checksums import parse_checksums
from miles_fsm.drivers.sglang.payload import serialize_named_tensors
from miles_fsm.drivers.sglang.protocol import EngineCapabilities, EngineChecksums
from miles_fsm.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["HttpConfig", "HttpTransport"]


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

