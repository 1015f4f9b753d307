"""The rules of the protocol-faithful SGLang test server: the engine's state, and what kills it.

It implements the endpoints and rules SGLang's engine enforces, its failure
behaviours included, so that the driver can be tested without SGLang (which
cannot be installed on the CPU machines). The rules come from SGLang's
sources (``../shared/notes/stack-facts.md``, and 0.5.17's own code in
``../shared/sglang-h200``), and those of 0.5.17 were checked against a real
0.5.17 server on an H200 (``benchmarks/results/sglang_h200.json``,
``docs/sglang.md``); where SGLang and this server differed, this server was
changed to do what SGLang does:

- two protocol generations: with sessions (0.5.21 and later, the default)
  and without (``sessions=False``, ``version="0.5.17"``), where
  ``/begin_weight_update`` and ``/end_weight_update`` answer 404 and updates
  need no session;
- routes answer 405 to a method they do not take and 404 when they do not
  exist (FastAPI), which is how the driver probes them (``OPTIONS``);
- memory errors come back as 400 ``{"error": {"message"}}``, update errors as
  400 ``{"success": false, "message"}``, a refused flush as 400 text;
- a double release, a resume of a tag that is not released, and a release
  while requests run or wait each kill the scheduler (0.5.17: a
  torch_memory_saver exit, a ``KeyError``, an ``AssertionError``, each
  raised in the scheduler, which takes the server down): the server drops
  the connection and stops serving for good;
- after a weights resume the weights are garbage (NaN) unless the server was
  started with weights CPU backup;
- with sessions, updates fail outside a begin/end session; a second begin,
  or an end with no session, answers ``success=False``; an end may carry
  ``abort``;
- ``/flush_cache`` answers 400 while requests run or wait in the queue
  (retracted ones included);
- ``weight_version`` is read with ``/model_info`` and set with a push or
  ``/update_weight_version``, which aborts running requests unless told not to;
- ``/server_info`` reports the version; ``/weights_checker`` with
  ``action=checksum`` reports a checksum per stored weight per TP rank.

Pushed tensors are really deserialized (SGLang's ForkingPickler + base64
format, through an allow-list unpickler like SGLang's, and the
``flattened_bucket`` format) or really received over a gloo broadcast group,
and kept, so tests compare them with the trainer's weights. ``FakeEngine``
exposes the same rules through the offline ``sglang.Engine`` method names.

``SGLangProtocol`` holds them once for both faces of the fake: the HTTP
server and ``FakeEngine`` (``sglang_server``), which only translate.
"""


from __future__ import annotations

import hashlib
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sglang_payloads import BlockedClassError, named_from, rank_digest, tensor_checksum, unpickle

__all__ = ["RESUME_ORDER", "TAGS", "ProtocolError", "SGLangProtocol", "ServerDied"]

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

    def __init__(
        self,
        *,
        tp_size: int = 1,
        weights_cpu_backup: bool = False,
        group_timeout_s: float = 10.0,
        sessions: bool = True,
        version: str = "0.5.23",
        weights_checker: bool = True,
    ) -> None:
        self.tp_size = tp_size
        self.weights_cpu_backup = weights_cpu_backup
        self.group_timeout_s = group_timeout_s
        self.sessions = sessions
        self.sglang_version = version
        self.weights_checker = weights_checker
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
        self.aborted_sessions = 0
        self.death: str | None = None
        #: Test hooks: fail the n-th call of an op (1-based) with (n, message[, status]); drop pushed
        #: versions; drop pushed tensors of these names silently (a loader that skips a name).
        self.fail_at: dict[str, tuple[Any, ...]] = {}
        self.drop_weight_version = False
        self.ignore_names: set[str] = set()
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

    def _die(self, why: str) -> ServerDied:
        # An exception in SGLang's scheduler, or torch_memory_saver's exit(1),
        # takes the whole server down: nothing answers any more.
        self.alive = False
        self.death = why
        return ServerDied(why)

    def _need_session(self, op: str) -> None:
        if self.sessions and not self.session_open:
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
            if name not in self.ignore_names:
                self.weights[name] = t.detach().clone()
        if version is not None and not self.drop_weight_version:
            self.version = version

    # ------------------------------------------------------------ memory

    def release(self, tags: list[str] | None) -> None:
        with self.lock:
            self._enter("release_memory_occupation")
            tags = self._tags(tags)
            if self.running or self.queued:
                # SGLang asserts an idle scheduler; the AssertionError kills it.
                raise self._die("release_memory_occupation should be called only when server is idle")
            for tag in tags:
                if tag in self.released:
                    # torch_memory_saver pauses paused memory: exit(1) in the scheduler.
                    raise self._die(f"double release of {tag!r}")
                self.released.add(tag)

    def resume(self, tags: list[str] | None) -> None:
        with self.lock:
            self._enter("resume_memory_occupation")
            tags = self._tags(tags) if tags else [t for t in TAGS if t in self.released]
            for tag in sorted(tags, key=RESUME_ORDER.index):
                if tag not in self.released:
                    # SGLang removes the tag from its set of released tags first: the
                    # KeyError is raised in the scheduler and kills it.
                    raise self._die(f"KeyError: {tag!r}")
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

    def end(self, *, abort: bool = False) -> tuple[bool, str]:
        with self.lock:
            self._enter("end_weight_update")
            if not self.session_open:
                return False, "no weight update session is open"
            self.session_open = False
            if abort:
                self.aborted_sessions += 1
            return True, "session aborted" if abort else "session ended"

    # ------------------------------------------------------------ updates

    def update_from_tensor(
        self, payloads: list[str | bytes], *, weight_version: str | None, load_format: str | None = None
    ) -> None:
        with self.lock:
            self._enter("update_weights_from_tensor")
            self._need_session("update_weights_from_tensor")
            if len(payloads) != self.tp_size:
                raise ProtocolError(
                    f"expected {self.tp_size} serialized payloads (one per TP rank), got {len(payloads)}", kind="update"
                )
            try:
                ranks = [named_from(unpickle(p), load_format) for p in payloads]
            except BlockedClassError as exc:
                raise ProtocolError(str(exc), kind="update") from exc
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

    def set_version(self, version: str, abort_all_requests: bool = True) -> None:
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
                # SGLang logs why; the answer only says it failed.
                raise ProtocolError("Flush cache failed.\n", kind="text")

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
            return {
                "model_path": "dummy",
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }

    def server_info(self) -> dict[str, Any]:
        with self.lock:
            self._enter("server_info")
            return {"version": self.sglang_version, "tp_size": self.tp_size}

    def checksums(self, action: str) -> dict[str, Any]:
        """``/weights_checker``: one checksum per stored weight, the same on every TP rank here."""
        with self.lock:
            self._enter("weights_checker")
            if action != "checksum":
                raise ProtocolError(f"Unsupported action={action!r}", kind="update")
            sums = {name: tensor_checksum(t) for name, t in self.weights.items()}
            ranks = [
                {
                    "checksums": dict(sums),
                    "per_gpu_checksum": rank_digest(sums),
                    "parallelism_info": {"tp_rank": r, "tp_size": self.tp_size},
                }
                for r in range(self.tp_size)
            ]
            engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
            return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": engine}


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
