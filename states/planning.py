"""Planning's parts: the guard's intents, engine outcomes shared, and the tensor set cached.

The intent a guard compares is built from rank-uniform facts only, and
reused while equal (``Intents``). The trainer's tensor set in it is walked
again only when the model's structure changes (``TensorSetCache``).

Every guarded transition compares a tensor set across ranks. Walking it
(``trainer.tensor_set()``: every param's name, shape and dtype, sorted and
hashed) costs milliseconds at thousands of tensors, several times the guard's
all-reduce. A trainer that has ``structure_version`` (``VersionedTrainer``)
says when the walk would give another answer; the set is cached per version.

Two checks keep the cache from hiding a per-rank change, the seed's bug:

- a version is trusted only if it is defined where ``tensor_set`` is (or
  below): a subclass that overrides ``tensor_set`` but inherits the version
  would change the set without moving it, so its set is walked every time;
- on a verified cycle the set is walked anyway and compared with the cached
  one; a difference is a ``StructureVersionError``, before the guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from miles_fsm.plan import Intent
from miles_fsm.states.definition import Side, Step, StepKind
from miles_fsm.states.errors import StructureVersionError

if TYPE_CHECKING:
    from miles_fsm.guard.consensus import Guard
    from miles_fsm.plan import Collective, TensorSet
    from miles_fsm.states.protocols import TrainerDriver, VersionedTrainer

__all__ = ["Intents", "TensorSetCache", "engine_side", "shared", "trusted_version"]

_NEVER = object()  # a version no driver returns: the first read always walks


def _definer(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def trusted_version(trainer: object) -> bool:
    """Whether ``trainer.structure_version`` may key the cache of its ``tensor_set()``."""
    if not hasattr(trainer, "structure_version"):
        return False
    cls = type(trainer)
    version_from, set_from = _definer(cls, "structure_version"), _definer(cls, "tensor_set")
    if version_from is None or set_from is None:
        return True  # instance attributes: nothing inherited to distrust
    # A tensor_set overridden in a subclass of the version's class is invisible to the version.
    return not (set_from is not version_from and issubclass(set_from, version_from))


class TensorSetCache:
    """``trainer.tensor_set()``, cached per ``structure_version``; walked every time without one."""

    def __init__(self, trainer: TrainerDriver) -> None:
        self._trainer = trainer
        self.versioned = trusted_version(trainer)
        self._version: Any = _NEVER
        self._set: TensorSet | None = None
        #: Walks of the tensor set so far (the benchmark and the tests read it).
        self.walks = 0

    def get(self, *, check: bool) -> TensorSet:
        """The tensor set; ``check`` walks it even for an unchanged version and compares."""
        if not self.versioned:
            return self._walk()
        # ``versioned``: trusted_version found the attribute, so the trainer is a VersionedTrainer.
        version = cast("VersionedTrainer", self._trainer).structure_version
        if version is None:  # the driver does not know now: walk, and forget the cache
            self._version, self._set = _NEVER, None
            return self._walk()
        if self._set is None or version != self._version:
            self._set, self._version = self._walk(), version
        elif check:
            self._compare(self._walk(), version)
        return self._set

    def _walk(self) -> TensorSet:
        self.walks += 1
        return self._trainer.tensor_set()

    def _compare(self, walked: TensorSet, version: Any) -> None:
        cached = self._set
        if cached is None or walked.digest == cached.digest:
            return
        old, new = set(map(str, cached.specs)), set(map(str, walked.specs))
        self.versioned, self._set = False, None  # a version caught lying is not trusted again
        raise StructureVersionError(driver=type(self._trainer).__qualname__, version=repr(version),
                                    added=sorted(new - old), removed=sorted(old - new))  # fmt: skip


class Intents:
    """The intent the guard compares, per trigger: the last one is reused while equal, hashed once."""

    def __init__(self, trainer: TrainerDriver) -> None:
        self._trainer = trainer
        self.tensor_sets = TensorSetCache(trainer)
        self._last: dict[str, Intent] = {}

    def get(self, trigger: str, source: str, dest: str, epoch: int, collectives: tuple[Collective, ...], *,
            check: bool) -> Intent:  # fmt: skip
        """The intent; ``check`` walks the tensor set even for an unchanged structure version."""
        tensors = self.tensor_sets.get(check=check)
        last = self._last.get(trigger)
        # A train step guarded every iteration asks for the same intent again: reuse it, hashed once.
        if (last is not None and last.tensors is tensors and last.epoch == epoch and last.source == source
                and last.dest == dest and last.collectives == collectives):  # fmt: skip
            return last
        intent = Intent(epoch=epoch, trigger=trigger, source=source, dest=dest,
                        strategy=self._trainer.strategy.value, collectives=collectives, tensors=tensors)  # fmt: skip
        self._last[trigger] = intent
        return intent


def engine_side(step: Step) -> bool:
    """Whether ``step`` calls the engine (the weight push does, from the trainer's side)."""
    return step.side is Side.ENGINE or step.kind is StepKind.PUSH_WEIGHTS


def shared(action: Callable[[Step, int], Any], guard: Guard, trigger: str) -> Callable[[Step, int], Any]:
    """``action``, then its outcome shared with every rank (see ``Lifecycle``'s ``engine_leader``)."""

    def run(step: Step, epoch: int) -> Any:
        try:
            report = action(step, epoch)
        except Exception as exc:  # handed to every rank, then re-raised here by share_outcome
            guard.share_outcome(exc, epoch=epoch, trigger=trigger, step=str(step))
            raise
        guard.share_outcome(None, epoch=epoch, trigger=trigger, step=str(step))
        return report

    return run
