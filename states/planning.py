"""The trainer's tensor set for planning, walked again only when the model's structure changes.

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

from typing import TYPE_CHECKING, Any

from miles_fsm.states.errors import StructureVersionError

if TYPE_CHECKING:
    from miles_fsm.plan import TensorSet
    from miles_fsm.states.protocols import TrainerDriver

__all__ = ["TensorSetCache", "trusted_version"]

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
        version = self._trainer.structure_version  # type: ignore[attr-defined]
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
