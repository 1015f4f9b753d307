"""The seams between the lifecycle and real systems.

A trainer driver and an engine driver are all the machine needs. Each step of
the transition table calls exactly one method here. Implement these for your
own stack; the reference drivers are the worked example (docs/embedding.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from miles_fsm.plan import Collective, TensorSet
from miles_fsm.states import Step, Strategy
from miles_fsm.states.errors import DriverProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["EngineDriver", "RematerializingTrainer", "StepReport", "TrainerDriver", "VersionedTrainer", "check_driver"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """What an action measured; every field is optional."""

    bytes_moved: int | None = None
    host_bytes: int | None = None


@runtime_checkable
class TrainerDriver(Protocol):
    """One trainer rank: its weights, its memory, its collectives.

    Exactly what the lifecycle calls under either weight strategy, and what
    ``check_driver`` requires of every trainer. A trainer whose ``strategy``
    is ``Strategy.REMATERIALIZE`` is a ``RematerializingTrainer``: it adds
    the two methods that strategy calls. A ``Strategy.BACKUP`` trainer needs
    only these. A driver may have more (the reference trainer's ``copy``
    and ``get``).
    """

    @property
    def strategy(self) -> Strategy:
        """How the actor's params come back after the engine had the GPU."""
        ...

    def backup(self, tag: str) -> StepReport | None:
        """Keep a host copy of what ``tag`` cannot rebuild."""
        ...

    def restore(self, tag: str) -> StepReport | None:
        """Write ``tag``'s host copy back into the model."""
        ...

    def pause_memory(self, tag: str) -> None:
        """Release the device memory of one tag (torch_memory_saver's pause)."""
        ...

    def resume_memory(self, tag: str) -> None:
        """Map one tag's memory back; contents are undefined unless backed up."""
        ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The full weights, in the engine's naming, for the push."""
        ...

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Every tensor that must come back bit-exact (verification hashes these)."""
        ...

    def tensor_set(self) -> TensorSet:
        """Names, shapes and dtypes of what the actor tag covers. Rank-uniform."""
        ...

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        """The collectives ``step`` will issue. Rank-uniform; never reads pause state."""
        ...

    def memory_in_use(self) -> int | None:
        """Device (or host, on CPU) bytes this trainer holds now, or None if unknown."""
        ...


@runtime_checkable
class RematerializingTrainer(TrainerDriver, Protocol):
    """A trainer whose ``strategy`` is ``Strategy.REMATERIALIZE``: the two methods that strategy adds.

    Under REMATERIALIZE no host copy of the bf16 params exists: at
    ``rematerialize`` the lifecycle calls ``cast_main_to_params``, then at
    ``sync`` ``param_sync``. Under BACKUP it calls neither, and
    ``check_driver`` does not require them.
    """

    def cast_main_to_params(self) -> StepReport | None:
        """Rebuild this rank's shard of the bf16 params from the fp32 master weights."""
        ...

    def param_sync(self) -> StepReport | None:
        """All-gather the params so that every rank holds them whole."""
        ...


@runtime_checkable
class VersionedTrainer(Protocol):
    """The optional member of a trainer driver that makes planning cheap at many tensors.

    Without it the lifecycle walks ``tensor_set()`` on every guarded
    transition (correct; milliseconds at thousands of tensors). With it the
    set is walked once per version, and again on every verified cycle to
    check the version (``StructureVersionError`` if the set moved and the
    version did not). Not part of ``TrainerDriver``: ``check_driver`` does
    not require it.
    """

    @property
    def structure_version(self) -> object:
        """A cheap value, compared with ``==``, that changes whenever ``tensor_set()`` would.

        Read on every guarded transition, so it must cost no walk. Cover
        every per-rank change (a param frozen on one rank only is exactly the
        change the guard exists to see). Return None where it cannot say: the
        set is then walked. A subclass that overrides ``tensor_set`` must
        override this too, or its inherited version is not trusted.
        """
        ...


@runtime_checkable
class EngineDriver(Protocol):
    """The rollout engine colocated with this rank."""

    @property
    def name(self) -> str:
        """How errors and traces name this engine (a URL, 'engine0')."""
        ...

    def release_memory(self, tag: str) -> None:
        """Release one memory tag (``weights``, ``kv_cache``, ``cuda_graph``)."""
        ...

    def resume_memory(self, tag: str) -> None:
        """Resume one released memory tag."""
        ...

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str) -> StepReport | None:
        """Push weights (inside one begin/end update session where the engine has them), then set ``version``."""
        ...

    def weight_version(self) -> str | None:
        """The version the engine reports serving now."""
        ...

    def weight_digests(self) -> Mapping[str, str] | None:
        """SHA256 of each served weight, or None if the engine cannot expose them."""
        ...

    def collectives(self, step: Step) -> tuple[Collective, ...]:
        """The collectives ``step`` will issue on the trainer side (e.g. a broadcast)."""
        ...


def check_driver(driver: object, protocol: type, role: str) -> None:
    """Refuse, at construction, a driver that lacks members of its protocol; name every missing one.

    ``isinstance`` against a runtime-checkable protocol only says no; this
    says what to add, before any transition half-runs into an AttributeError.
    A ``TrainerDriver`` whose ``strategy`` is REMATERIALIZE is held to
    ``RematerializingTrainer``, which adds the two methods that strategy calls.
    """
    if protocol is TrainerDriver and getattr(driver, "strategy", None) is Strategy.REMATERIALIZE:
        protocol = RematerializingTrainer
    members = sorted(name for name in dir(protocol) if not name.startswith("_"))
    missing = [name for name in members if not hasattr(driver, name)]
    if missing:
        raise DriverProtocolError(role=role, driver=type(driver).__qualname__, missing=missing,
                                  protocol=protocol.__name__)  # fmt: skip
