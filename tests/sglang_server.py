"""The protocol-faithful SGLang test server over real HTTP on a free loopback port, and ``FakeEngine``.

Both are faces of ``SGLangProtocol`` (``sglang_rules``, whose docstring lists
the rules and where each came from): the HTTP server maps routes, methods and
response shapes the way SGLang's FastAPI server does (a 405 for a method a
route does not take, a 404 for an unknown path, a dropped connection once the
scheduler died), and ``FakeEngine`` uses the offline ``sglang.Engine`` method
names.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang_rules import ProtocolError, SGLangProtocol, ServerDied

__all__ = ["FakeEngine", "FakeEngineWithoutSessions", "SGLangTestServer", "serve"]

#: Path -> the HTTP methods its route takes (SGLang 0.5.17's http_server.py; the
#: session routes are 0.5.21's). Anything else is a 405, an unknown path a 404.
ROUTES = {
    "/release_memory_occupation": ("GET", "POST"),
    "/resume_memory_occupation": ("GET", "POST"),
    "/begin_weight_update": ("POST",),
    "/end_weight_update": ("POST",),
    "/update_weights_from_tensor": ("POST",),
    "/init_weights_update_group": ("POST",),
    "/update_weights_from_distributed": ("POST",),
    "/destroy_weights_update_group": ("POST",),
    "/update_weight_version": ("POST",),
    "/flush_cache": ("GET", "POST"),
    "/pause_generation": ("POST",),
    "/continue_generation": ("POST",),
    "/model_info": ("GET",),
    "/server_info": ("GET",),
    "/get_server_info": ("GET",),
    "/weights_checker": ("GET", "POST"),
}
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")

# ---------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes; no 40 ms delayed-ACK stall
    server: SGLangTestServer

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else {}

    def _send(self, status: int, payload: Any) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._dispatch("GET", {})

    def do_POST(self) -> None:
        self._dispatch("POST", self._body())

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS", {})

    def _route_exists(self, path: str) -> bool:
        proto = self.server.protocol
        if path in SESSION_ROUTES:
            return proto.sessions
        if path == "/weights_checker":
            return proto.weights_checker
        return path in ROUTES

    def _dispatch(self, method: str, body: dict[str, Any]) -> None:
        proto = self.server.protocol
        path = self.path.split("?", 1)[0]
        try:
            if not proto.alive:
                raise ServerDied(path)
            if not self._route_exists(path):
                self._send(404, {"detail": "Not Found"})
                return
            if method not in ROUTES[path]:
                self._send(405, {"detail": "Method Not Allowed"})
                return
            self._send(200, self._call(proto, path, body))
        except ProtocolError as exc:
            if exc.kind == "update":
                self._send(exc.status, {"success": False, "message": exc.message})
            elif exc.kind == "text":
                self._send(exc.status, exc.message)
            else:
                self._send(exc.status, {"error": {"message": exc.message}})
        except ServerDied:
            # The scheduler is gone: no answer, and the server stops serving.
            self.close_connection = True
            self.server.die()

    @staticmethod
    def _call(proto: SGLangProtocol, path: str, body: dict[str, Any]) -> Any:
        """One request's answer body, as SGLang 0.5.17 shapes it."""
        ok = {"success": True, "message": "Success"}
        if path == "/release_memory_occupation":
            proto.release(body.get("tags"))
            return None  # the endpoint returns nothing: a JSON null
        if path == "/resume_memory_occupation":
            proto.resume(body.get("tags"))
            return None
        if path in SESSION_ROUTES:
            if path == "/begin_weight_update":
                success, message = proto.begin()
            else:
                success, message = proto.end(abort=bool(body.get("abort", False)))
            return {"success": success, "message": message}
        if path == "/update_weights_from_tensor":
            proto.update_from_tensor(
                body["serialized_named_tensors"],
                weight_version=body.get("weight_version"),
                load_format=body.get("load_format"),
            )
            return ok
        if path == "/init_weights_update_group":
            keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
            proto.init_group(**{k: body[k] for k in keys}, backend=body.get("backend", "nccl"))
            return ok
        if path == "/update_weights_from_distributed":
            proto.update_from_distributed(
                names=body["names"],
                dtypes=body["dtypes"],
                shapes=body["shapes"],
                group_name=body["group_name"],
                weight_version=body.get("weight_version"),
            )
            return ok
        if path == "/destroy_weights_update_group":
            proto.destroy_group(body["group_name"])
            return ok
        if path == "/update_weight_version":
            version = str(body["new_version"])
            proto.set_version(version, bool(body.get("abort_all_requests", True)))
            return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        if path == "/flush_cache":
            proto.flush_cache()
            return (
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        if path == "/pause_generation":
            proto.pause_generation(body.get("mode", "abort"))
            return {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            proto.continue_generation()
            return {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/model_info":
            return proto.model_info()
        if path in ("/server_info", "/get_server_info"):
            return proto.server_info()
        if path == "/weights_checker":
            return proto.checksums(body.get("action", "checksum"))
        raise AssertionError(f"a route without a handler: {path}")


class SGLangTestServer(ThreadingHTTPServer):
    """The protocol over HTTP; ``url`` is ``http://127.0.0.1:<free port>``."""

    daemon_threads = True

    def __init__(self, protocol: SGLangProtocol) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.protocol = protocol
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def serving(self) -> bool:
        return not self._stopped.is_set()

    def start(self) -> SGLangTestServer:
        self._thread.start()
        return self

    def die(self) -> None:
        """Stop serving from inside a handler (shutdown() would deadlock on this thread)."""
        if not self._stopped.is_set():
            self._stopped.set()
            threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self.shutdown()
        self.server_close()


@contextmanager
def serve(**protocol_kwargs: Any) -> Iterator[SGLangTestServer]:
    """A running test server on a free loopback port, stopped afterwards."""
    server = SGLangTestServer(SGLangProtocol(**protocol_kwargs)).start()
    try:
        yield server
    finally:
        if server._thread.is_alive():
            server.stop()
            server._thread.join(5)


# ------------------------------------------------------------- offline


class FakeEngine:
    """The offline ``sglang.Engine`` method names over the same rules (for the Engine transport).

    With the default ``sessions=True`` it has ``begin_weight_update`` /
    ``end_weight_update``; ``FakeEngineWithoutSessions`` is 0.5.17's Engine,
    which has neither.
    """

    def __init__(self, **protocol_kwargs: Any) -> None:
        self.protocol = SGLangProtocol(**protocol_kwargs)

    def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ServerDied as exc:
            raise RuntimeError(f"the scheduler died ({exc})") from exc
        except ProtocolError as exc:
            if exc.kind == "update":
                return False, exc.message
            raise RuntimeError(exc.message) from exc

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._do(self.protocol.release, tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._do(self.protocol.resume, tags)

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        return self._do(self.protocol.begin)

    def end_weight_update(self, abort: bool = False) -> tuple[bool, str]:
        return self._do(self.protocol.end, abort=abort)

    def update_weights_from_tensor(
        self, named_tensors: list[Any], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        if load_format == "flattened_bucket":
            # The Engine takes a flattened bucket already serialized, one payload per TP rank.
            result = self._do(self.protocol.update_from_tensor, named_tensors, weight_version=None, load_format=load_format)
        else:
            result = self._do(self.protocol.update_from_named, named_tensors)
        return result if result is not None else (True, "Success")

    def flush_cache(self) -> None:
        self._do(self.protocol.flush_cache)

    def get_model_info(self) -> dict[str, Any]:
        return self._do(self.protocol.model_info)

    def get_server_info(self) -> dict[str, Any]:
        return self._do(self.protocol.server_info)


class FakeEngineWithoutSessions(FakeEngine):
    """0.5.17's offline Engine: no weight-update sessions, updates work without one."""

    begin_weight_update = None  # type: ignore[assignment]
    end_weight_update = None  # type: ignore[assignment]

    def __init__(self, **protocol_kwargs: Any) -> None:
        super().__init__(**{"sessions": False, "version": "0.5.17", **protocol_kwargs})
