"""SGLang as the lifecycle's engine: over HTTP, or as an offline ``sglang.Engine``.

``SGLangEngineDriver`` implements ``EngineDriver`` over one or more engines
(one trainer group may feed several). It turns SGLang's sharp edges into
guarded steps (facts: ``../shared/notes/stack-facts.md``, SGLang 0.5.23):

- a double release kills the scheduler, so the driver tracks released tags per
  engine and refuses with ``MemoryTagError`` before anything is sent;
- updates fail outside a begin/end session (since 0.5.21), so every push runs
  inside one, and a failure mid-update ends every session it opened and says
  which could not be ended (``EngineUpdateError``);
- the version set with a push is read back; a mismatch is a
  ``WeightVersionError`` naming both versions.

Every engine error surfaces as ``EngineRequestError`` (or a subclass), never as
a raw HTTP or transport error. The transports (``HttpTransport``,
``EngineTransport``, in ``sglang_transport.py``) only speak the protocol; the
driver owns the rules.
Wiring and the failure table: ``docs/sglang.md``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, EngineUpdateError
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError, WeightVersionError

if TYPE_CHECKING:
    import torch

    from miles_fsm.states.protocols import StepReport
    from miles_fsm.plan import Collective
    from miles_fsm.states import Step

from miles_fsm.drivers.sglang_transport import (
    EngineTransport,
    HttpConfig,
    HttpTransport,
    SGLangTransport,
    buckets,
    serialize_named_tensors,
)

__all__ = [
    "MEMORY_TAGS",
    "PAUSE_MODES",
    "RESUME_ORDER",
    "DistributedConfig",
    "EngineTransport",
    "HttpConfig",
    "HttpTransport",
    "SGLangConfig",
    "SGLangEngineDriver",
    "SGLangTransport",
    "buckets",
    "serialize_named_tensors",
]

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
#: SGLang resumes in this order; the driver does too when given several tags.
RESUME_ORDER = ("cuda_graph", "weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")


# ------------------------------------------------------------------ configs


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
    load_format: str | None = None
    #: Flush the radix cache once after the session ends (the KV of old weights is stale).
    flush_cache: bool = True
    #: ``pause_generation`` mode around a push, or None to leave generation alone.
    #: "abort" is the one that leaves nothing pending, which a flush needs.
    pause_mode: str | None = "abort"
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        problems = []
        if self.method not in ("tensor", "distributed"):
            problems.append(f"method must be 'tensor' or 'distributed', got {self.method!r}")
        if self.bucket_bytes < 1:
            problems.append(f"bucket_bytes must be >= 1, got {self.bucket_bytes!r}")
        if self.tp_size < 1:
            problems.append(f"tp_size must be >= 1, got {self.tp_size!r}")
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


# ------------------------------------------------------------------- driver


def _check_tag(tag: str) -> None:
    if tag not in MEMORY_TAGS:
        raise ConfigError([f"unknown SGLang memory tag {tag!r}; the tags are {', '.join(MEMORY_TAGS)}"], "memory tag")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SGLangEngineDriver:
    """``EngineDriver`` over one or more SGLang engines fed by one trainer group.

    Memory calls go to every engine; the driver keeps, per engine, the tags it
    has released. It refuses a release when every engine has the tag released
    and a resume when none has, with ``MemoryTagError`` and nothing sent; after
    a partial failure it only touches the engines that still need the call, so
    ``Lifecycle.recover`` can finish the job without a double release.
    """

    def __init__(self, transports: Sequence[SGLangTransport], *, config: SGLangConfig | None = None) -> None:
        if not transports:
            raise ConfigError(["at least one engine is needed"], "SGLangEngineDriver")
        names = [t.name for t in transports]
        if len(set(names)) != len(names):
            raise ConfigError([f"engine names must be unique, got {names}"], "SGLangEngineDriver")
        self._transports = tuple(transports)
        self._config = config or SGLangConfig()
        self._released: dict[str, set[str]] = {n: set() for n in names}
        self._open_sessions: dict[str, str] = {}
        self._stale: set[str] = set()
        self._pushed: dict[str, str] = {}
        self._groups = 0

    @classmethod
    def http(
        cls, urls: str | Sequence[str], *, config: SGLangConfig | None = None, http: HttpConfig | None = None
    ) -> SGLangEngineDriver:
        """Engines behind SGLang HTTP servers (``python -m sglang.launch_server``)."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        return cls([HttpTransport(u, config=http) for u in urls], config=config)

    @classmethod
    def offline(cls, engines: Any | Sequence[Any], *, config: SGLangConfig | None = None) -> SGLangEngineDriver:
        """Offline ``sglang.Engine`` objects (already started by the caller)."""
        engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        return cls([EngineTransport(e, name=f"engine{i}") for i, e in enumerate(engines)], config=config)

    # ------------------------------------------------------------- facts

    @property
    def name(self) -> str:
        if len(self._transports) == 1:
            return self._transports[0].name
        return "sglang[" + ", ".join(t.name for t in self._transports) + "]"

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._transports)

    @property
    def config(self) -> SGLangConfig:
        return self._config

    @property
    def released(self) -> Mapping[str, frozenset[str]]:
        """Tags released now, per engine, as far as this driver knows."""
        return {n: frozenset(tags) for n, tags in self._released.items()}

    @property
    def open_sessions(self) -> Mapping[str, str]:
        """Engines with a weight-update session a failure left open, and where it happened."""
        return dict(self._open_sessions)

    @property
    def stale(self) -> frozenset[str]:
        """Engines whose weights were resumed and not pushed since: their contents are garbage."""
        return frozenset(self._stale)

    # ------------------------------------------------------------- memory

    def release_memory(self, tag: str) -> None:
        """Release ``tag`` on every engine that holds it."""
        _check_tag(tag)
        targets = [t for t in self._transports if tag not in self._released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="pause", paused=self._all_released())
        for t in targets:
            self._memory_call(t, tag, release=True)

    def resume_memory(self, tag: str) -> None:
        """Resume ``tag`` on every engine that released it."""
        _check_tag(tag)
        targets = [t for t in self._transports if tag in self._released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="resume", paused=self._all_released())
        for t in targets:
            self._memory_call(t, tag, release=False)

    def release_all(self, tags: Sequence[str] | None = None) -> None:
        """Release several tags (None: all three), one request per tag."""
        for tag in tags or MEMORY_TAGS:
            self.release_memory(tag)

    def resume_all(self, tags: Sequence[str] | None = None) -> None:
        """Resume several tags (None: every released one) in SGLang's order: cuda_graph, weights, kv_cache."""
        wanted = set(tags) if tags else set(self._all_released())
        for tag in wanted:
            _check_tag(tag)
        for tag in RESUME_ORDER:
            if tag in wanted:
                self.resume_memory(tag)

    def _all_released(self) -> set[str]:
        return set().union(*self._released.values())

    def _memory_call(self, t: SGLangTransport, tag: str, *, release: bool) -> None:
        try:
            (t.release if release else t.resume)([tag])
        except EngineRequestError as exc:
            if exc.status is None:
                # No answer: the call may have happened. Assume the tag is
                # released either way, the side that cannot kill the engine: a
                # later resume of an active tag fails cleanly, a second
                # release of a released tag kills the scheduler.
                self._released[t.name].add(tag)
                exc.add_note(
                    f"miles-fsm: {t.name} is assumed to have {tag!r} released now (no answer); a resume is safe"
                )
            raise
        if release:
            self._released[t.name].add(tag)
        else:
            self._released[t.name].discard(tag)
            if tag == "weights":
                self._stale.add(t.name)

    # ------------------------------------------------------------- weights

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str) -> StepReport | None:
        """Push ``named`` to every engine in one session each, set ``version``, read it back."""
        from miles_fsm.states.protocols import StepReport

        named = list(named)
        if self._open_sessions:
            where = ", ".join(f"{e} ({op})" for e, op in self._open_sessions.items())
            raise EngineSessionError(
                engine=", ".join(self._open_sessions),
                op="update_weights",
                detail=f"sessions left open by an earlier failure: {where}; call close_sessions() first",
            )
        for t in self._transports:
            if "weights" in self._released[t.name]:
                raise EngineSessionError(
                    engine=t.name,
                    op="update_weights",
                    detail="its 'weights' memory is released; resume it before pushing (nothing was sent)",
                )
        parts = list(buckets(named, self._config.bucket_bytes))
        state = _UpdateState()
        try:
            self._fan_out(state, "pause_generation", self._pause_generation)
            for t in self._transports:
                state.at(t, "begin_weight_update")
                t.begin_update()
                state.opened.append(t)
            if self._config.method == "tensor":
                self._push_tensors(state, parts, version)
            else:
                self._push_distributed(state, parts, version)
            for t in list(state.opened):
                state.at(t, "end_weight_update")
                t.end_update()
                state.opened.remove(t)
            if self._config.flush_cache:
                self._fan_out(state, "flush_cache", lambda t: t.flush_cache())
            self._fan_out(state, "continue_generation", self._continue_generation)
        # Any failure, the engine's or the trainer side's broadcast, ends the
        # sessions it opened before it propagates, and is reported with them.
        except Exception as exc:  # noqa: BLE001
            raise self._abort_update(state, exc) from exc
        for t in self._transports:
            if t.sets_version:
                actual = t.version()
                if actual != version:
                    raise WeightVersionError(engine=t.name, expected=version, actual=actual)
            self._pushed[t.name] = version
            self._stale.discard(t.name)
        moved = sum(x.numel() * x.element_size() for _, x in named) * len(self._transports)
        return StepReport(bytes_moved=moved)

    def _fan_out(self, state: _UpdateState, op: str, fn: Callable[[SGLangTransport], None]) -> None:
        for t in self._transports:
            state.at(t, op)
            fn(t)

    def _pause_generation(self, t: SGLangTransport) -> None:
        if self._config.pause_mode is not None:
            t.pause_generation(self._config.pause_mode)

    def _continue_generation(self, t: SGLangTransport) -> None:
        if self._config.pause_mode is not None:
            t.continue_generation()

    def _push_tensors(self, state: _UpdateState, parts: list[list[tuple[str, torch.Tensor]]], version: str) -> None:
        cfg = self._config
        for i, bucket in enumerate(parts):
            last = i == len(parts) - 1
            for t in self._transports:
                state.at(t, f"update_weights_from_tensor (bucket {i + 1}/{len(parts)})")
                t.update_from_tensor(
                    bucket,
                    tp_size=cfg.tp_size,
                    load_format=cfg.load_format,
                    # Never flush inside an update: a flush refused there fails
                    # the update itself. One /flush_cache after the session
                    # fails on its own, with its own error.
                    flush_cache=False,
                    weight_version=version if last and t.sets_version else None,
                )
        if not parts:
            self._set_versions(state, version)

    def _set_versions(self, state: _UpdateState, version: str) -> None:
        for t in self._transports:
            if t.sets_version:
                state.at(t, "update_weight_version")
                t.set_version(version)

    def _push_distributed(self, state: _UpdateState, parts: list[list[tuple[str, torch.Tensor]]], version: str) -> None:
        import torch.distributed as dist

        cfg = self._config.distributed
        tp = self._config.tp_size
        port = cfg.master_port or _free_port(cfg.master_address)
        world = 1 + tp * len(self._transports)
        # A fresh name per push: a group a failed push stranded on an engine
        # can never block the next one.
        self._groups += 1
        name = f"{cfg.group_name}_{self._groups}"
        pool = ThreadPoolExecutor(max_workers=len(self._transports) + 1, thread_name_prefix="sglang-push")
        clean = False
        try:
            joins: dict[SGLangTransport | None, Future[Any]] = {
                t: pool.submit(
                    t.init_group,
                    master_address=cfg.master_address,
                    master_port=port,
                    rank_offset=1 + i * tp,
                    world_size=world,
                    group_name=name,
                    backend=cfg.backend,
                )
                for i, t in enumerate(self._transports)
            }
            joins[None] = pool.submit(_trainer_group, cfg, name, port, world)
            self._wait(state, "init_weights_update_group", joins)
            group = joins[None].result()
            try:
                for i, bucket in enumerate(parts):
                    last = i == len(parts) - 1
                    requests: dict[SGLangTransport | None, Future[Any]] = {
                        t: pool.submit(
                            t.update_from_distributed,
                            names=[n for n, _ in bucket],
                            dtypes=[str(x.dtype).removeprefix("torch.") for _, x in bucket],
                            shapes=[list(x.shape) for _, x in bucket],
                            group_name=name,
                            flush_cache=False,
                            load_format=self._config.load_format,
                            weight_version=version if last and t.sets_version else None,
                        )
                        for t in self._transports
                    }
                    requests[None] = pool.submit(_broadcast, bucket, group)
                    self._wait(state, f"update_weights_from_distributed (bucket {i + 1}/{len(parts)})", requests)
                if not parts:
                    self._set_versions(state, version)
            finally:
                dist.destroy_process_group(group)
            destroys: dict[SGLangTransport | None, Future[Any]] = {
                t: pool.submit(t.destroy_group, name) for t in self._transports
            }
            self._wait(state, "destroy_weights_update_group", destroys)
            clean = True
        finally:
            # After a failure some threads may still wait in a rendezvous or a
            # broadcast that will never complete; they end at the group's
            # timeout, and must not hold the error back until then.
            pool.shutdown(wait=clean, cancel_futures=True)

    @staticmethod
    def _wait(state: _UpdateState, op: str, futures: Mapping[SGLangTransport | None, Future[Any]]) -> None:
        """Wait until all succeed or one fails; a failure is raised at once, naming its engine.

        An engine that refused a request never joins the collective, so its
        error is the news, not the trainer side's timeout that would follow.
        """
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for t, fut in futures.items():
                if fut in done and fut.exception() is not None:
                    state.at(t, op if t is not None else f"{op} (trainer side)")
                    raise fut.exception()  # type: ignore[misc]

    def _abort_update(self, state: _UpdateState, exc: BaseException) -> EngineUpdateError:
        closed: list[str] = []
        left_open: list[str] = []
        for t in state.opened:
            try:
                t.end_update()
            except (EngineRequestError, EngineSessionError) as end_exc:
                left_open.append(t.name)
                self._open_sessions[t.name] = f"{state.op} failed; end_weight_update then failed: {end_exc}"
            else:
                closed.append(t.name)
        unpaused: list[str] = []
        if self._config.pause_mode is not None:
            for t in self._transports:
                try:
                    t.continue_generation()
                except (EngineRequestError, EngineSessionError):
                    unpaused.append(t.name)
        engine = state.engine.name if state.engine is not None else "trainer"
        err = EngineUpdateError(
            engine=engine,
            op=state.op,
            status=getattr(exc, "status", None),
            message=getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}",
            closed=closed,
            left_open=left_open,
        )
        if unpaused:
            err.add_note(f"miles-fsm: continue_generation failed on {unpaused}; generation there stays paused")
        return err

    def close_sessions(self) -> list[str]:
        """End the sessions a failed update left open; returns the engines it ended them on."""
        ended = []
        by_name = {t.name: t for t in self._transports}
        for name in list(self._open_sessions):
            try:
                by_name[name].end_update()
            except EngineSessionError:
                pass  # success=False: no session is open there any more, which is what we wanted
            del self._open_sessions[name]
            ended.append(name)
        return ended

    def weight_version(self) -> str | None:
        """The version every engine serves; engines that disagree raise ``WeightVersionError``."""
        versions = {t.name: (t.version() if t.sets_version else self._pushed.get(t.name)) for t in self._transports}
        first = next(iter(versions.values()))
        for name, v in versions.items():
            if v != first:
                raise WeightVersionError(engine=name, expected=str(first), actual=v)
        return first

    def weight_digests(self) -> Mapping[str, str] | None:
        """SGLang exposes no per-weight hashes; the version check is what the driver can verify."""
        return None

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        """None on the trainer group: the distributed push uses a private group per engine set."""
        return ()

    # -------------------------------------------------------- generation

    def flush_cache(self) -> None:
        for t in self._transports:
            t.flush_cache()

    def pause_generation(self, mode: str | None = None) -> None:
        mode = mode or self._config.pause_mode or "abort"
        if mode not in PAUSE_MODES:
            raise ConfigError([f"pause mode must be one of {PAUSE_MODES}, got {mode!r}"], "pause_generation")
        for t in self._transports:
            t.pause_generation(mode)

    def continue_generation(self) -> None:
        for t in self._transports:
            t.continue_generation()

    def close(self) -> None:
        """Close the HTTP clients. Sessions still open are reported, not hidden."""
        for t in self._transports:
            t.close()
        if self._open_sessions:
            raise EngineSessionError(
                engine=", ".join(self._open_sessions),
                op="close",
                detail=f"sessions are still open: {self._open_sessions}",
            )


class _UpdateState:
    """Where an update is: the engine and step now running, and the sessions it opened."""

    __slots__ = ("engine", "op", "opened")

    def __init__(self) -> None:
        self.engine: SGLangTransport | None = None
        self.op = "start"
        self.opened: list[SGLangTransport] = []

    def at(self, engine: SGLangTransport | None, op: str) -> None:
        self.engine = engine
        self.op = op


def _broadcast(bucket: Sequence[tuple[str, torch.Tensor]], group: Any) -> None:
    import torch.distributed as dist

    for _, x in bucket:
        dist.broadcast(x.detach().contiguous(), src=0, group=group)


def _trainer_group(cfg: DistributedConfig, name: str, port: int, world: int) -> Any:
    """Rank 0 of the broadcast group, built the way SGLang builds its side.

    SGLang's ``init_custom_process_group``: a TCP rendezvous, a ``PrefixStore``
    named after the group, then ``_new_process_group_helper`` (private torch
    API, used the same way by SGLang, OpenRLHF and slime), so the store keys of
    both sides match.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=cfg.timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{cfg.master_address}:{port}", 0, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(cfg.backend), store, group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
