"""SGLang as the lifecycle's engine: over HTTP, or as an offline ``sglang.Engine``.

``SGLangEngineDriver`` implements ``EngineDriver`` over one or more engines
(one trainer group may feed several). It turns SGLang's sharp edges into
guarded steps (facts: ``../shared/notes/stack-facts.md``; run against real
SGLang 0.5.17 on an H200, ``docs/sglang.md``):

- a double release, a resume of a tag that is not released, and a release
  while requests run each kill the scheduler, so the driver tracks released
  tags per engine and refuses with ``MemoryTagError`` before anything is
  sent, and pauses generation (``abort``) before it releases anything;
  generation continues only once every tag is back;
- what an engine supports is probed once per engine
  (``EngineCapabilities``): updates run inside a begin/end session where the
  engine has sessions (0.5.21 and later; outside one they fail), and without
  one where it has none (0.5.17). A failure mid-update ends every session it
  opened with ``abort`` and says which could not be ended
  (``EngineUpdateError``);
- the version set with a push is read back; a mismatch is a
  ``WeightVersionError`` naming both versions;
- where the engine has ``/weights_checker``, its own checksums are read after
  each push and compared with the checksums the trainer expects
  (``SGLangConfig.expected_checksums``) or, without those, across the engines
  that received the same push (``WeightChecksumError``).

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

from miles_fsm.drivers.errors import (
    EngineRequestError,
    EngineSessionError,
    EngineUpdateError,
    WeightChecksumError,
)
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError, WeightVersionError

if TYPE_CHECKING:
    import torch

    from miles_fsm.states.protocols import StepReport
    from miles_fsm.plan import Collective
    from miles_fsm.states import Step

from miles_fsm.drivers.sglang_transport import (
    EngineCapabilities,
    EngineChecksums,
    EngineTransport,
    HttpConfig,
    HttpTransport,
    SGLangTransport,
    buckets,
    flattened_bucket_class,
    serialize_named_tensors,
)

__all__ = [
    "MEMORY_TAGS",
    "PAUSE_MODES",
    "RESUME_ORDER",
    "DistributedConfig",
    "EngineCapabilities",
    "EngineChecksums",
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

#: Maps the pushed weights to the checksums each TP rank of an engine must then report
#: (SGLang's names and hash; see ``SGLangConfig.expected_checksums``).
ExpectedChecksums = Callable[[Sequence[tuple[str, "torch.Tensor"]]], Sequence[Mapping[str, str]]]


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

    def __post_init__(self) -> None:
        problems = []
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

    Unless ``pause_mode`` is None, generation is paused (``abort``) on an
    engine before its first release and continued once every tag is back on
    it: a release with requests in flight kills the scheduler, and requests
    must not run while weights or KV cache are released.
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
        self._capabilities: dict[str, EngineCapabilities] = {}
        self._checksums: dict[str, EngineChecksums] = {}
        self._paused: set[str] = set()
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

    @property
    def paused(self) -> frozenset[str]:
        """Engines on which this driver paused generation and has not continued it yet."""
        return frozenset(self._paused)

    @property
    def checksums(self) -> Mapping[str, EngineChecksums]:
        """The engines' own checksums read after the last verified push (engines with a checker)."""
        return dict(self._checksums)

    def capabilities(self) -> Mapping[str, EngineCapabilities]:
        """What each engine supports, probed on first use and kept (one probe per engine)."""
        for t in self._transports:
            if t.name not in self._capabilities:
                self._capabilities[t.name] = t.probe()
        return dict(self._capabilities)

    # ------------------------------------------------------------- memory

    def release_memory(self, tag: str) -> None:
        """Release ``tag`` on every engine that holds it (pausing generation there first)."""
        _check_tag(tag)
        targets = [t for t in self._transports if tag not in self._released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="pause", paused=self._all_released())
        for t in targets:
            if self._config.pause_mode is not None and t.name not in self._paused:
                # "abort" whatever pause_mode says: retracted or in-place requests
                # keep the scheduler busy, and a busy release kills it.
                t.pause_generation("abort")
                self._paused.add(t.name)
            self._memory_call(t, tag, release=True)

    def resume_memory(self, tag: str) -> None:
        """Resume ``tag`` on every engine that released it; continue generation where all tags are back."""
        _check_tag(tag)
        targets = [t for t in self._transports if tag in self._released[t.name]]
        if not targets:
            raise MemoryTagError(side="engine", tag=tag, op="resume", paused=self._all_released())
        for t in targets:
            self._memory_call(t, tag, release=False)
            self._continue_if_resident(t)

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

    def _continue_if_resident(self, t: SGLangTransport) -> None:
        """Continue generation on ``t`` if this driver paused it and every tag is back."""
        if t.name in self._paused and not self._released[t.name]:
            t.continue_generation()
            self._paused.discard(t.name)

    # ------------------------------------------------------------- weights

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str) -> StepReport | None:
        """Push ``named`` to every engine (in a session where it has them), set ``version``, read it back.

        Then, where the engine has ``/weights_checker``, compare its own
        checksums with the expected ones (``SGLangConfig.expected_checksums``)
        or with the other engines' (``WeightChecksumError``).
        """
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
        if self._config.load_format == "flattened_bucket":
            flattened_bucket_class()  # a missing sglang is reported before anything is sent
        caps = self.capabilities()
        parts = list(buckets(named, self._config.bucket_bytes))
        state = _UpdateState()
        try:
            if self._config.pause_mode is not None:
                for t in self._transports:
                    if t.name not in self._paused:
                        state.at(t, "pause_generation")
                        t.pause_generation(self._config.pause_mode)
                        self._paused.add(t.name)
            for t in self._transports:
                if caps[t.name].sessions:
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
            self._fan_out(state, "continue_generation", self._continue_if_resident)
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
        self._verify_checksums(named, caps)
        moved = sum(x.numel() * x.element_size() for _, x in named) * len(self._transports)
        return StepReport(bytes_moved=moved)

    def _verify_checksums(
        self, named: Sequence[tuple[str, torch.Tensor]], caps: Mapping[str, EngineCapabilities]
    ) -> None:
        checked = [t for t in self._transports if caps[t.name].weights_checker]
        if not self._config.verify_checksums or not checked:
            return
        got = {t.name: t.checksums() for t in checked}
        self._checksums = got
        if self._config.expected_checksums is not None:
            expected = [dict(m) for m in self._config.expected_checksums(named)]
            for engine, sums in got.items():
                _compare_checksums(engine, "the checksums the trainer expects", expected, sums.ranks)
            return
        first, *others = checked
        for t in others:
            _compare_checksums(t.name, f"engine {first.name}", got[first.name].ranks, got[t.name].ranks)

    def _fan_out(self, state: _UpdateState, op: str, fn: Callable[[SGLangTransport], None]) -> None:
        for t in self._transports:
            state.at(t, op)
            fn(t)

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
                t.end_update(abort=True)
            except (EngineRequestError, EngineSessionError) as end_exc:
                left_open.append(t.name)
                self._open_sessions[t.name] = f"{state.op} failed; end_weight_update(abort) then failed: {end_exc}"
            else:
                closed.append(t.name)
        unpaused: list[str] = []
        for t in self._transports:
            try:
                self._continue_if_resident(t)
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
        """End (with ``abort``) the sessions a failed update left open; returns the engines it ended them on."""
        ended = []
        by_name = {t.name: t for t in self._transports}
        for name in list(self._open_sessions):
            try:
                by_name[name].end_update(abort=True)
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
        """Continue generation on every engine, including those the driver paused around a release."""
        for t in self._transports:
            t.continue_generation()
            self._paused.discard(t.name)

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


def _compare_checksums(
    engine: str, against: str, expected: Sequence[Mapping[str, str]], actual: Sequence[Mapping[str, str]]
) -> None:
    """Raise ``WeightChecksumError`` unless every TP rank reports the checksums of ``expected``.

    Names only ``actual`` has are ignored against the trainer's expectation
    (the engine holds more than the trainer pushes), but count when the
    reference is another engine, which must hold exactly the same.
    """
    if len(expected) != len(actual):
        raise WeightChecksumError(
            engine=engine,
            against=against,
            mismatched=[f"(the number of TP ranks: {len(actual)} reported, {len(expected)} expected)"],
            missing=[],
        )
    strict = against.startswith("engine ")
    mismatched: list[str] = []
    missing: list[str] = []
    for rank, (want, have) in enumerate(zip(expected, actual)):
        prefix = f"rank {rank}: " if len(expected) > 1 else ""
        for name in sorted(want):
            if name not in have:
                missing.append(prefix + name)
            elif have[name] != want[name]:
                mismatched.append(prefix + name)
        if strict:
            mismatched.extend(prefix + name for name in sorted(set(have) - set(want)))
    if mismatched or missing:
        raise WeightChecksumError(engine=engine, against=against, mismatched=mismatched, missing=missing)


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
