"""The lifecycle's actions: one function per step kind, each calling one driver method.

``Actions.table`` maps every ``StepKind`` to its action; the machine runs
them in table order. Verification lives here too: ``record_digests`` at
offload, ``verify`` at resume, and the pushed weights against the engine's
own digests at pause.

On a GPU the digests recorded at offload are only queued (``start_digests``):
the kernel hashes beside the offload's own copies, and the host waits for it
(joins) just before anything could release or write what it reads: a pause
of a tag that may hold the verified tensors (all tags unless the trainer
names them in ``verified_tags``), or a step that writes params. The wait is
traced as the ``verified`` record's ``waited_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from time import perf_counter
from types import MappingProxyType
from typing import TYPE_CHECKING, cast

from miles_fsm import digest_device
from miles_fsm.config import VerifyConfig
from miles_fsm.digest import DIGEST_SCHEME, PendingDigests, digest_tensors, start_digests
from miles_fsm.plan import TensorSet
from miles_fsm.states.definition import Side, State, Step, StepKind, Trigger
from miles_fsm.states.errors import TensorSetChangedError, VerificationError, WeightVersionError
from miles_fsm.states.memory import MemoryLedger
from miles_fsm.states.protocols import StepReport
from miles_fsm.trace.schema import VERIFIED, VERIFY_FAILED

if TYPE_CHECKING:
    from miles_fsm.states.protocols import EngineDriver, RematerializingTrainer, TrainerDriver
    from miles_fsm.trace.writer import TraceSink

__all__ = ["Actions"]

Action = Callable[[Step, int], "StepReport | None"]


class Actions:
    """The step bodies over one trainer, an optional engine and their memory ledgers."""

    def __init__(
        self,
        *,
        trainer: TrainerDriver,
        engine: EngineDriver | None,
        verify: VerifyConfig,
        tracer: TraceSink,
        calls_engine: bool = True,
    ) -> None:
        self._trainer = trainer
        # A rank that does not call its engine (another rank does, for it) keeps the
        # engine's ledger all the same, so its memory state and its plan stay the others'.
        self._engine = engine if calls_engine else None
        self._verify_config = verify
        self._tracer = tracer
        self.memory = MappingProxyType(
            {
                Side.TRAINER: MemoryLedger(Side.TRAINER.value, pause=self._pause_trainer,
                                           resume=trainer.resume_memory),  # fmt: skip
                Side.ENGINE: MemoryLedger(
                    Side.ENGINE.value,
                    pause=engine.release_memory if engine is not None and calls_engine else _not_here,
                    resume=engine.resume_memory if engine is not None and calls_engine else _not_here,
                ),
            }
        )
        #: (epoch, tensor set, digests) recorded at offload, checked at resume.
        self._recorded: tuple[int, TensorSet, PendingDigests] | None = None
        #: Seconds the host waited for the recorded digests at their join, this cycle.
        self._waited_s = 0.0
        self._verified_tags: frozenset[str] | None = None
        self._tags_read_at: object = None  # the trainer's structure_version when they were read
        self.table: Mapping[StepKind, Action] = MappingProxyType(
            {
                StepKind.BACKUP: self.backup,
                StepKind.RECORD_DIGESTS: self.record_digests,
                StepKind.PAUSE_MEMORY: self.pause_memory,
                StepKind.RESUME_MEMORY: self.resume_memory,
                StepKind.PUSH_WEIGHTS: self.push_weights,
                StepKind.CAST_MAIN_TO_PARAMS: self.cast_main_to_params,
                StepKind.RESTORE: self.restore,
                StepKind.PARAM_SYNC: self.param_sync,
                StepKind.VERIFY: self.verify,
            }
        )

    @property
    def pending_verification(self) -> int | None:
        """The epoch whose digests were recorded and not yet checked, if any."""
        return self._recorded[0] if self._recorded is not None else None

    def verifies(self, epoch: int) -> bool:
        return self._verify_config.active(epoch, on_device=digest_device.available())

    def pause_memory(self, step: Step, epoch: int) -> None:
        self.memory[step.side].pause(step.tags)

    def resume_memory(self, step: Step, epoch: int) -> None:
        self.memory[step.side].resume(step.tags)

    def backup(self, step: Step, epoch: int) -> StepReport | None:
        return _merge([self._trainer.backup(tag) for tag in step.tags])

    def cast_main_to_params(self, step: Step, epoch: int) -> StepReport | None:
        self._join()
        return self._rematerializing.cast_main_to_params()

    def param_sync(self, step: Step, epoch: int) -> StepReport | None:
        self._join()
        return self._rematerializing.param_sync()

    @property
    def _rematerializing(self) -> RematerializingTrainer:
        # Only REMATERIALIZE's steps call this, and check_driver held such a trainer to that protocol.
        return cast("RematerializingTrainer", self._trainer)

    def restore(self, step: Step, epoch: int) -> StepReport | None:
        self._join()
        return _merge([self._trainer.restore(tag) for tag in step.tags])

    def record_digests(self, step: Step, epoch: int) -> None:
        if not self.verifies(epoch):
            self._recorded = None
            return
        tensors = self._trainer.tensors()
        threads = self._verify_config.threads
        pending = start_digests(tensors, threads=threads)  # first: the host work below overlaps the kernel
        # The memory tags that hold tensors() (None: unknown), read again when the trainer's structure
        # changed (a buffer registered since would change them).
        version = getattr(self._trainer, "structure_version", None)
        if version is None or version != self._tags_read_at:
            held = getattr(self._trainer, "verified_tags", None)
            self._verified_tags = frozenset(held) if held is not None else None
            self._tags_read_at = version
        self._waited_s = 0.0
        self._recorded = (epoch, TensorSet.of(tensors.items()), pending)

    def _join(self) -> None:
        """Land the recorded digests, waiting only if the device is still at them: what they read may change
        next. Landing drops the kernel's copies of unaligned inputs too, which would otherwise stay through
        PAUSED; no root is hashed here, ``verify`` compares the chunk digests."""
        if self._recorded is None:
            return
        pending = self._recorded[2]
        waits, t0 = not pending.ready, perf_counter()
        pending.wait()
        if waits:
            self._waited_s += perf_counter() - t0

    def _pause_trainer(self, tag: str) -> None:
        if self._verified_tags is None or tag in self._verified_tags:
            self._join()
        self._trainer.pause_memory(tag)

    def verify(self, step: Step, epoch: int) -> None:
        if self._recorded is None or self._recorded[0] != epoch:
            return
        _, before_set, recorded = self._recorded
        self._join()
        # Chunk digests, not roots: equal sizes (the tensor set below) make them equal exactly when the
        # roots are, and hashing 2 x hundreds of roots is the verified cycle's own cost.
        before = recorded.chunks()
        tensors = self._trainer.tensors()
        # Queued before the tensor set is compared: on a GPU that host work overlaps the kernel.
        pending = start_digests(tensors, threads=self._verify_config.threads)
        after_set = TensorSet.of(tensors.items())
        try:
            if after_set != before_set:
                pending.chunks()  # joined: nothing may still read the tensors when the error leaves
                raise TensorSetChangedError(
                    epoch=epoch,
                    added=sorted(after_set.names - before_set.names),
                    removed=sorted(before_set.names - after_set.names),
                )
            after = pending.chunks()
            bad = sorted(n for n in before if before[n] != after[n])
            if bad:
                raise VerificationError(epoch=epoch, mismatched=bad)
        except VerificationError as exc:
            # The record stays: a recovery must not let the next resume skip the check.
            self._trace_failed(exc, epoch, Trigger.RESUME, State.SYNCED)
            raise
        self._recorded = None
        self._tracer.emit(VERIFIED, epoch=epoch, trigger=Trigger.RESUME.value, state=State.SYNCED.value,
                          tensors=len(after), scheme=DIGEST_SCHEME, waited_s=self._waited_s)  # fmt: skip

    def push_weights(self, step: Step, epoch: int) -> StepReport | None:
        engine = self._engine
        if engine is None:  # another rank pushes for this one; the planner drops the step without any engine
            return None
        named = list(self._trainer.named_weights())
        version = str(epoch)
        report = engine.update_weights(named, version=version)
        actual = engine.weight_version()
        if actual != version:
            raise WeightVersionError(engine=engine.name, expected=version, actual=actual)
        if self.verifies(epoch):
            served = engine.weight_digests()
            if served is not None:
                try:
                    _compare_served(engine.name, epoch, served, digest_tensors(dict(named),
                                                                               threads=self._verify_config.threads))
                except VerificationError as exc:
                    self._trace_failed(exc, epoch, Trigger.PAUSE, State.OFFLOADED)
                    raise
        return report

    def _trace_failed(self, exc: VerificationError, epoch: int, trigger: Trigger, state: State) -> None:
        self._tracer.emit(VERIFY_FAILED, epoch=epoch, trigger=trigger.value, state=state.value,
                          tensors=list(exc.mismatched), where=exc.where, scheme=DIGEST_SCHEME)  # fmt: skip


def _compare_served(engine: str, epoch: int, served: Mapping[str, str], pushed: Mapping[str, str]) -> None:
    if set(served) != set(pushed):
        raise TensorSetChangedError(
            epoch=epoch,
            added=sorted(set(served) - set(pushed)),
            removed=sorted(set(pushed) - set(served)),
            where=f"engine {engine}",
        )
    bad = sorted(n for n in pushed if pushed[n] != served[n])
    if bad:
        raise VerificationError(epoch=epoch, mismatched=bad, where=f"engine {engine}")


def _not_here(tag: str) -> None:
    """Engine memory moves on the rank that calls the engine; elsewhere the ledger alone keeps count."""


def _merge(reports: list[StepReport | None]) -> StepReport | None:
    real = [r for r in reports if r is not None]
    if not real:
        return None

    def total(field: str) -> int | None:
        values = [getattr(r, field) for r in real if getattr(r, field) is not None]
        return sum(values) if values else None

    return StepReport(bytes_moved=total("bytes_moved"), host_bytes=total("host_bytes"))
