"""SGLang as the lifecycle's engine: over HTTP, or as an offline ``sglang.Engine``.

``SGLangEngineDriver`` implements ``EngineDriver`` over one or more engines
(one trainer group may feed several). It turns SGLang's sharp edges into
guarded steps (facts: ``../shared/notes/stack-facts.md``; run against real
SGLang 0.5.17 on an H200, ``docs/sglang.md``):

- a double release, a resume of a tag that is not released, and a release
  while requests run each kill the scheduler: the ledger of released tags
  (``memory``) refuses with ``MemoryTagError`` before anything is sent;
- what an engine supports is probed once per engine
  (``EngineCapabilities``): updates run inside a begin/end session where the
  engine has sessions (0.5.21 and later; outside one they fail), and without
  one where it has none (0.5.17). A failure mid-update ends every session it
  opened with ``abort`` and says which could not be ended
  (``EngineUpdateError``);
- the version set with a push is read back; a mismatch is a
  ``WeightVersionError`` naming both versions;
- where the engine has ``/weights_checker``, its own checksums are read after
  each push and compared (``checksums``, ``WeightChecksumError``).

Every engine error surfaces as ``EngineRequestError`` (or a subclass), never as
a raw HTTP or transport error. The transports (``http``,
``offline``) only speak the protocol (``protocol``); the push
itself is ``push``; this module owns the order of the steps, and
gathers the public names of the others so callers import from one place.
Wiring and the failure table: ``docs/sglang.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, EngineUpdateError
from miles_fsm.drivers.sglang.checksums import verify_checksums
from miles_fsm.drivers.sglang.config import PAUSE_MODES, DistributedConfig, SGLangConfig
from miles_fsm.drivers.sglang.http import HttpConfig, HttpTransport
from miles_fsm.drivers.sglang.memory import MEMORY_TAGS, RESUME_ORDER, EngineMemory
from miles_fsm.drivers.sglang.offline import EngineTransport
from miles_fsm.drivers.sglang.payload import buckets, flattened_bucket_class, serialize_named_tensors
from miles_fsm.drivers.sglang.protocol import EngineCapabilities, EngineChecksums, SGLangTransport
from miles_fsm.drivers.sglang.push import UpdateState, push_distributed, push_tensors
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import WeightVersionError

if TYPE_CHECKING:
    import sglang
    import torch

    from miles_fsm.plan import Collective
    from miles_fsm.states import Step
    from miles_fsm.states.protocols import StepReport

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
        self._memory = EngineMemory(self._transports, pause=self._config.pause_mode is not None,
                                    probe=self._config.memory_probe)  # fmt: skip
        self._open_sessions: dict[str, str] = {}
        self._pushed: dict[str, str] = {}
        self._capabilities: dict[str, EngineCapabilities] = {}
        self._checksums: dict[str, EngineChecksums] = {}
        self._groups = 0

    @classmethod
    def http(
        cls, urls: str | Sequence[str], *, config: SGLangConfig | None = None, http: HttpConfig | None = None
    ) -> SGLangEngineDriver:
        """Engines behind SGLang HTTP servers (``python -m sglang.launch_server``)."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        return cls([HttpTransport(u, config=http) for u in urls], config=config)

    @classmethod
    def offline(
        cls, engines: sglang.Engine | Sequence[sglang.Engine], *, config: SGLangConfig | None = None
    ) -> SGLangEngineDriver:
        """Offline ``sglang.Engine`` objects (already started by the caller)."""
        listed = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        return cls([EngineTransport(e, name=f"engine{i}") for i, e in enumerate(listed)], config=config)

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
        return {n: frozenset(tags) for n, tags in self._memory.released.items()}

    @property
    def open_sessions(self) -> Mapping[str, str]:
        """Engines with a weight-update session a failure left open, and where it happened."""
        return dict(self._open_sessions)

    @property
    def stale(self) -> frozenset[str]:
        """Engines whose weights were resumed and not pushed since: their contents are garbage."""
        return frozenset(self._memory.stale)

    @property
    def paused(self) -> frozenset[str]:
        """Engines on which this driver paused generation and has not continued it yet."""
        return frozenset(self._memory.paused)

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
        self._memory.release(tag)

    def resume_memory(self, tag: str) -> None:
        """Resume ``tag`` on every engine that released it; continue generation where all tags are back."""
        self._memory.resume(tag)

    def release_all(self, tags: Sequence[str] | None = None) -> None:
        """Release several tags (None: all three), one request per tag."""
        self._memory.release_all(tags)

    @property
    def memory_log(self) -> tuple[Mapping[str, Any], ...]:
        """Each measured release and resume, oldest first (``SGLangConfig.memory_probe``; empty without one)."""
        return tuple(self._memory.log)

    def device_bytes_by_tag(self) -> dict[str, int]:
        """Per tag, the device bytes its last resume took back (the drift snapshot's ``engine:`` figures)."""
        return dict(self._memory.taken)

    def host_bytes_by_tag(self) -> dict[str, int]:
        """The engine's host memory is not measured from here."""
        return {}

    def resume_all(self, tags: Sequence[str] | None = None) -> None:
        """Resume several tags (None: every released one) in SGLang's order: cuda_graph, weights, kv_cache."""
        self._memory.resume_all(tags)

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
            if "weights" in self._memory.released[t.name]:
                raise EngineSessionError(
                    engine=t.name,
                    op="update_weights",
                    detail="its 'weights' memory is released; resume it before pushing (nothing was sent)",
                )
        if self._config.load_format == "flattened_bucket":
            flattened_bucket_class()  # a missing sglang is reported before anything is sent
        caps = self.capabilities()
        parts = list(buckets(named, self._config.bucket_bytes))
        state = UpdateState()
        try:
            if self._config.pause_mode is not None:
                for t in self._transports:
                    if t.name not in self._memory.paused:
                        state.at(t, "pause_generation")
                        t.pause_generation(self._config.pause_mode)
                        self._memory.paused.add(t.name)
            for t in self._transports:
                if caps[t.name].sessions:
                    state.at(t, "begin_weight_update")
                    t.begin_update()
                    state.opened.append(t)
            if self._config.method == "tensor":
                push_tensors(self._transports, self._config, state, parts, version)
            else:
                # A fresh group name per push: a group a failed push stranded
                # on an engine can never block the next one.
                self._groups += 1
                name = f"{self._config.distributed.group_name}_{self._groups}"
                push_distributed(self._transports, self._config, state, parts, version, group_name=name)
            for t in list(state.opened):
                state.at(t, "end_weight_update")
                t.end_update()
                state.opened.remove(t)
            if self._config.flush_cache:
                self._fan_out(state, "flush_cache", lambda t: t.flush_cache())
            self._fan_out(state, "continue_generation", self._memory.continue_if_resident)
        # Any failure, the engine's or the trainer side's broadcast, ends the
        # sessions it opened before it propagates, and is reported with them.
        except Exception as exc:
            raise self._abort_update(state, exc) from exc
        for t in self._transports:
            if t.sets_version:
                actual = t.version()
                if actual != version:
                    raise WeightVersionError(engine=t.name, expected=version, actual=actual)
            self._pushed[t.name] = version
            self._memory.stale.discard(t.name)
        self._verify_checksums(named, caps)
        moved = sum(x.numel() * x.element_size() for _, x in named) * len(self._transports)
        return StepReport(bytes_moved=moved)

    def _verify_checksums(
        self, named: Sequence[tuple[str, torch.Tensor]], caps: Mapping[str, EngineCapabilities]
    ) -> None:
        checked = [t for t in self._transports if caps[t.name].weights_checker]
        if not self._config.verify_checksums or not checked:
            return
        # Kept before the comparison: a mismatch is worth reading afterwards.
        self._checksums = {t.name: t.checksums() for t in checked}
        verify_checksums(self._checksums, named, self._config.expected_checksums)


    def _fan_out(self, state: UpdateState, op: str, fn: Callable[[SGLangTransport], None]) -> None:
        for t in self._transports:
            state.at(t, op)
            fn(t)

    def _abort_update(self, state: UpdateState, exc: BaseException) -> EngineUpdateError:
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
                self._memory.continue_if_resident(t)
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
            self._memory.paused.discard(t.name)

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

