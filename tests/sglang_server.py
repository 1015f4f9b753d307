"""A protocol-faithful SGLang test server, over real HTTP on a free loopback port.

It implements the endpoints and rules of ``../shared/notes/stack-facts.md``
(SGLang 0.5.23), the failure behaviours included, so that the driver can be
tested without SGLang (which cannot be installed here):

- errors come back as 400 ``{"error": {"message"}}`` (memory calls) or 400
  ``{"success": false, "message"}`` (update calls), as SGLang sends them;
- release needs an idle scheduler (no running requests);
- a double release reaches torch_memory_saver's double pause, which kills the
  scheduler: the server drops the connection and stops serving for good;
- resuming a tag that was never released fails (SGLang raises ``KeyError``);
- after a weights resume the weights are garbage (NaN) unless the server was
  started with weights CPU backup;
- updates fail outside a begin/end session; a second begin, or an end with no
  session, answers ``success=False``;
- ``/flush_cache`` answers 400 while requests run or wait in the queue;
- ``weight_version`` is read with ``/model_info`` and set with a push or
  ``/update_weight_version``.

Pushed tensors are really deserialized (SGLang's ForkingPickler + base64
format) or really received over a gloo broadcast group, and kept, so tests
compare them with the trainer's weights. ``FakeEngine`` exposes the same
rules through the offline ``sglang.Engine`` method names.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (torch's reductions, to unpickle shared tensors)

__all__ = ["FakeEngine", "ProtocolError", "SGLangProtocol", "SGLangTestServer", "ServerDied", "serve"]

TAGS = ("kv_cache", "weights", "cuda_graph")
RESUME_ORDER = ("cuda_graph", "weights", "kv_cache")


class ProtocolError(Exception):
    """A request SGLang rejects; ``kind`` picks the response shape."""

    def __init__(self, message: str, *, kind: str = "error", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind  # "error": {"error": {"message"}}; "update": {"success": false}; "text"
        self.status = status


class ServerDied(Exception):
    """The scheduler died (torch_memory_saver's exit(1)); nothing answers any more."""


class SGLangProtocol:
    """The engine's state and rules, shared by the HTTP server and ``FakeEngine``."""

    def __init__(self, *, tp_size: int = 1, weights_cpu_backup: bool = False, group_timeout_s: float = 10.0) -> None:
        self.tp_size = tp_size
        self.weights_cpu_backup = weights_cpu_backup
        self.group_timeout_s = group_timeout_s
        self.lock = threading.Lock()
        self.alive = True
        self.released: set[str] = set()
        self.session_open = False
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.running = 0
        self.queued = 0
        self.paused_mode: str | None = None
        self.groups: dict[str, list[Any]] = {}
        self.calls: list[str] = []
        #: Test hooks: fail the n-th call of an op (1-based) with (n, message[, status]); drop pushed versions.
        self.fail_at: dict[str, tuple[Any, ...]] = {}
        self.drop_weight_version = False
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------ helpers

    def _enter(self, op: str) -> None:
        if not self.alive:
            raise ServerDied(op)
        self.calls.append(op)
        self._counts[op] = self._counts.get(op, 0) + 1
        hit = self.fail_at.get(op)
        if hit is not None and hit[0] == self._counts[op]:
            status = hit[2] if len(hit) > 2 else 400
            raise ProtocolError(hit[1], kind="update" if op.startswith("update") else "error", status=status)

    def _need_session(self, op: str) -> None:
        if not self.session_open:
            raise ProtocolError(
                f"{op} must run inside a weight update session (begin_weight_update first)", kind="update"
            )
        if "weights" in self.released:
            raise ProtocolError(f"{op}: weights memory is released", kind="update")

    @staticmethod
    def _tags(tags: list[str] | None) -> list[str]:
        out = list(tags) if tags else list(TAGS)
        for t in out:
            if t not in TAGS:
                raise ProtocolError(f"unknown memory tag {t!r}")
        return out

    def _store(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        for name, t in named:
            self.weights[name] = t.detach().clone()
        if version is not None and not self.drop_weight_version:
            self.version = version

    # ------------------------------------------------------------ memory

    def release(self, tags: list[str] | None) -> None:
        with self.lock:
            self._enter("release_memory_occupation")
            tags = self._tags(tags)
            if self.running:
                raise ProtocolError("release_memory_occupation needs an idle scheduler; requests are running")
            for tag in tags:
                if tag in self.released:
                    # torch_memory_saver pauses paused memory: exit(1) in the scheduler.
                    self.alive = False
                    raise ServerDied(f"double release of {tag!r}")
                self.released.add(tag)

    def resume(self, tags: list[str] | None) -> None:
        with self.lock:
            self._enter("resume_memory_occupation")
            tags = self._tags(tags) if tags else [t for t in TAGS if t in self.released]
            for tag in sorted(tags, key=RESUME_ORDER.index):
                if tag not in self.released:
                    raise ProtocolError(f"KeyError: {tag!r}")
                self.released.discard(tag)
                if tag == "weights" and not self.weights_cpu_backup:
                    for w in self.weights.values():
                        w.fill_(float("nan"))

    # ------------------------------------------------------------ sessions

    def begin(self) -> tuple[bool, str]:
        with self.lock:
            self._enter("begin_weight_update")
            if self.session_open:
                return False, "a weight update session is already open"
            self.session_open = True
            return True, "session opened"

    def end(self) -> tuple[bool, str]:
        with self.lock:
            self._enter("end_weight_update")
            if not self.session_open:
                return False, "no weight update session is open"
            self.session_open = False
            return True, "session ended"

    # ------------------------------------------------------------ updates

    def update_from_tensor(self, payloads: list[str | bytes], *, weight_version: str | None) -> None:
        with self.lock:
            self._enter("update_weights_from_tensor")
            self._need_session("update_weights_from_tensor")
            if len(payloads) != self.tp_size:
                raise ProtocolError(
                    f"expected {self.tp_size} serialized payloads (one per TP rank), got {len(payloads)}", kind="update"
                )
            ranks = [pickle.loads(base64.b64decode(p)) if isinstance(p, str) else p for p in payloads]
            if any([n for n, _ in r] != [n for n, _ in ranks[0]] for r in ranks):
                raise ProtocolError("TP ranks received different tensors", kind="update")
            self._store(ranks[0], weight_version)

    def update_from_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The offline Engine's push: tensors arrive as objects (CUDA IPC in real SGLang)."""
        with self.lock:
            self._enter("update_weights_from_tensor")
            self._need_session("update_weights_from_tensor")
            self._store(named, None)

    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        with self.lock:
            self._enter("init_weights_update_group")
            if backend != "gloo":
                raise ProtocolError(f"the test server speaks gloo only, not {backend!r}", kind="update")
            if group_name in self.groups:
                raise ProtocolError(f"group {group_name!r} already exists", kind="update")
        timeout = timedelta(seconds=self.group_timeout_s)
        members: list[Any] = [None] * self.tp_size

        def join(tp_rank: int) -> None:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
            # The keys SGLang's init_custom_process_group and the trainer's
            # _new_process_group_helper use for a gloo group.
            prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
            members[tp_rank] = dist.ProcessGroupGloo(prefixed, rank_offset + tp_rank, world_size, timeout)

        _run_all(join, self.tp_size)
        with self.lock:
            self.groups[group_name] = members

    def update_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
    ) -> None:
        with self.lock:
            self._enter("update_weights_from_distributed")
            self._need_session("update_weights_from_distributed")
            members = self.groups.get(group_name)
            if members is None:
                raise ProtocolError(f"no weight update group {group_name!r}", kind="update")
        received: list[list[tuple[str, torch.Tensor]]] = [[] for _ in members]

        def recv(tp_rank: int) -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                members[tp_rank].broadcast([t], opts).wait()
                received[tp_rank].append((name, t))

        _run_all(recv, len(members))
        with self.lock:
            self._store(received[0], weight_version)

    def destroy_group(self, group_name: str) -> None:
        with self.lock:
            self._enter("destroy_weights_update_group")
            if self.groups.pop(group_name, None) is None:
                raise ProtocolError(f"no weight update group {group_name!r}", kind="update")

    def set_version(self, version: str, abort_all_requests: bool = False) -> None:
        with self.lock:
            self._enter("update_weight_version")
            if abort_all_requests:
                self.running = 0
            self.version = version

    # ------------------------------------------------------------ generation

    def flush_cache(self) -> None:
        with self.lock:
            self._enter("flush_cache")
            if self.running or self.queued:
                raise ProtocolError(
                    f"Cache not flushed because there are pending requests. #queue-req: {self.queued}, "
                    f"#running-req: {self.running}",
                    kind="text",
                )

    def pause_generation(self, mode: str) -> None:
        with self.lock:
            self._enter("pause_generation")
            if mode not in ("abort", "retract", "in_place"):
                raise ProtocolError(f"unknown pause mode {mode!r}")
            if mode == "abort":
                self.running = 0
            elif mode == "retract":
                self.queued += self.running
                self.running = 0
            self.paused_mode = mode

    def continue_generation(self) -> None:
        with self.lock:
            self._enter("continue_generation")
            self.paused_mode = None
            self.running += self.queued
            self.queued = 0

    def model_info(self) -> dict[str, Any]:
        with self.lock:
            self._enter("model_info")
            return {"model_path": "dummy", "is_generation": True, "weight_version": self.version}


def _run_all(fn: Any, n: int) -> None:
    """Run ``fn(i)`` for each TP rank in its own thread (the ranks meet in a collective)."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            fn(i)
        except Exception as exc:  # noqa: BLE001 - carried to the caller below, as the 400 SGLang would send
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise ProtocolError(f"{type(errors[0]).__name__}: {errors[0]}", kind="update")


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
        self._dispatch({})

    def do_POST(self) -> None:
        self._dispatch(self._body())

    def _dispatch(self, body: dict[str, Any]) -> None:
        proto = self.server.protocol
        path = self.path.split("?", 1)[0]
        ok = {"success": True, "message": "Succeeded"}
        try:
            if not proto.alive:
                raise ServerDied(path)
            if path == "/release_memory_occupation":
                proto.release(body.get("tags"))
                self._send(200, ok)
            elif path == "/resume_memory_occupation":
                proto.resume(body.get("tags"))
                self._send(200, ok)
            elif path in ("/begin_weight_update", "/end_weight_update"):
                success, message = proto.begin() if path == "/begin_weight_update" else proto.end()
                self._send(200, {"success": success, "message": message})
            elif path == "/update_weights_from_tensor":
                proto.update_from_tensor(body["serialized_named_tensors"], weight_version=body.get("weight_version"))
                self._send(200, ok)
            elif path == "/init_weights_update_group":
                keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
                proto.init_group(**{k: body[k] for k in keys}, backend=body.get("backend", "nccl"))
                self._send(200, ok)
            elif path == "/update_weights_from_distributed":
                proto.update_from_distributed(
                    names=body["names"],
                    dtypes=body["dtypes"],
                    shapes=body["shapes"],
                    group_name=body["group_name"],
                    weight_version=body.get("weight_version"),
                )
                self._send(200, ok)
            elif path == "/destroy_weights_update_group":
                proto.destroy_group(body["group_name"])
                self._send(200, ok)
            elif path == "/update_weight_version":
                proto.set_version(str(body["new_version"]), bool(body.get("abort_all_requests", False)))
                self._send(200, ok)
            elif path == "/flush_cache":
                proto.flush_cache()
                self._send(200, "Cache flushed.")
            elif path == "/pause_generation":
                proto.pause_generation(body.get("mode", "abort"))
                self._send(200, ok)
            elif path == "/continue_generation":
                proto.continue_generation()
                self._send(200, ok)
            elif path == "/model_info":
                self._send(200, proto.model_info())
            else:
                self._send(404, {"detail": "Not Found"})
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
    """The offline ``sglang.Engine`` method names over the same rules (for the Engine transport)."""

    def __init__(self, **protocol_kwargs: Any) -> None:
        self.protocol = SGLangProtocol(**protocol_kwargs)

    def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ServerDied as exc:
            raise RuntimeError(f"the scheduler died ({exc})") from exc
        except ProtocolError as exc:
            if exc.message.startswith("KeyError"):
                raise KeyError(exc.message) from exc
            if exc.kind == "update":
                return False, exc.message
            raise RuntimeError(exc.message) from exc

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._do(self.protocol.release, tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._do(self.protocol.resume, tags)

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        return self._do(self.protocol.begin)

    def end_weight_update(self) -> tuple[bool, str]:
        return self._do(self.protocol.end)

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        result = self._do(self.protocol.update_from_named, named_tensors)
        return result if result is not None else (True, "Succeeded")

    def flush_cache(self) -> None:
        self._do(self.protocol.flush_cache)

    def get_model_info(self) -> dict[str, Any]:
        return self._do(self.protocol.model_info)
