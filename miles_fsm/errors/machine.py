"""The machine's own failures: its table, its transitions, its configs, its memory, a rank gone FAILED."""

from __future__ import annotations

from collections.abc import Sequence

from miles_fsm.errors.base import MilesFsmError

__all__ = [
    "ConfigError",
    "DefinitionError",
    "MemoryReleasedError",
    "ProcessGroupMissingError",
    "RankFailedError",
    "TransitionCancelled",
    "TransitionNotAllowed",
]


class DefinitionError(MilesFsmError, ValueError):
    """The transition table is malformed; raised when it is built."""

    #: Every problem found in the definition, one line each.
    problems: tuple[str, ...]

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid lifecycle definition:\n  - " + "\n  - ".join(self.problems))


class TransitionNotAllowed(MilesFsmError, RuntimeError):
    """A trigger was fired in a state that has no arrow for it. Nothing ran."""

    #: The state the trigger was fired in.
    state: str
    #: The trigger that has no arrow from ``state``.
    trigger: str
    #: The triggers that ``state`` does allow.
    allowed: tuple[str, ...]
    #: In FAILED: the error that put the machine there (else None).
    failure: BaseException | None

    def __init__(
        self,
        state: str,
        trigger: str,
        allowed: Sequence[str] = (),
        failure: BaseException | None = None,
    ) -> None:
        self.state = state
        self.trigger = trigger
        self.allowed = tuple(allowed)
        self.failure = failure
        if failure is not None:
            hint = (
                f"the rank FAILED earlier ({type(failure).__name__}: {failure}); "
                "call Lifecycle.recover(to=...) once you know what state memory is in"
            )
        elif self.allowed:
            hint = "allowed here: " + ", ".join(self.allowed)
        else:
            hint = "no trigger leaves this state"
        super().__init__(f"trigger {trigger!r} is not allowed in state {state}; {hint}")


class TransitionCancelled(MilesFsmError, RuntimeError):
    """A transition was abandoned before its guard: no collective was entered."""

    #: The abandoned transition's trigger.
    trigger: str
    #: Its epoch.
    epoch: int

    def __init__(self, trigger: str, epoch: int) -> None:
        self.trigger = trigger
        self.epoch = epoch
        super().__init__(
            f"{trigger} (epoch {epoch}) was cancelled before its guard; this rank entered no "
            "collective and its state is unchanged, but the other ranks will fail their guard"
        )


class ProcessGroupMissingError(MilesFsmError, RuntimeError):
    """The environment says this is one rank of several, but torch.distributed is not initialized."""

    #: The world size the environment announces (``WORLD_SIZE``).
    world_size: int
    #: The rank the environment announces (``RANK``), or None.
    rank: str | None

    def __init__(self, *, world_size: int, rank: str | None) -> None:
        self.world_size = world_size
        self.rank = rank
        super().__init__(
            f"WORLD_SIZE={world_size} (RANK={rank}) but torch.distributed is not initialized, so this rank would "
            "run alone: its guards would check nothing and its trace would claim rank 0. Call "
            "torch.distributed.init_process_group() before building the Lifecycle, or pass guard=Guard.solo() "
            "to run one rank on purpose."
        )


class ConfigError(MilesFsmError, ValueError):
    """The configuration violates constraints; every violation is listed."""

    #: Every constraint the configuration violates, one line each.
    violations: tuple[str, ...]
    #: What was configured (``LifecycleConfig``, ``TrainerConfig``, ...).
    what: str

    def __init__(self, violations: Sequence[str], what: str = "configuration") -> None:
        self.violations = tuple(violations)
        self.what = what
        super().__init__(
            f"{what} violates {len(self.violations)} constraint(s):\n  - "
            + "\n  - ".join(self.violations)
        )


class MemoryReleasedError(MilesFsmError, RuntimeError):
    """Work was asked of memory that is released (or came back without its contents)."""

    #: Who was asked the work (``trainer``, an engine's name).
    owner: str
    #: The work that was refused (``train_step``, ``generate``, ...).
    op: str
    #: The memory tags that are not usable, sorted.
    tags: tuple[str, ...]
    #: Why they are not usable ("" : they are released).
    reason: str

    def __init__(self, *, owner: str, op: str, tags: Sequence[str], reason: str = "") -> None:
        self.owner = owner
        self.op = op
        self.tags = tuple(sorted(tags))
        self.reason = reason
        why = reason or "they are released"
        super().__init__(
            f"{owner} cannot {op}: memory tag(s) [{', '.join(self.tags)}] are not usable ({why}). "
            "Resume them and reload their contents (push weights, restore) first."
        )


class RankFailedError(MilesFsmError, RuntimeError):
    """A task waited for a state, and the rank went FAILED instead."""

    #: The rank that went FAILED.
    rank: int
    #: The state the task was waiting for.
    waiting_for: str
    #: The trigger whose transition failed.
    trigger: str
    #: Its epoch.
    epoch: int
    #: The step that failed, as traced (None: its guard).
    step: str | None
    #: The failure's error, as text.
    cause: str

    def __init__(self, *, rank: int, waiting_for: str, trigger: str, epoch: int, step: str | None, cause: str) -> None:
        self.rank = rank
        self.waiting_for = waiting_for
        self.trigger = trigger
        self.epoch = epoch
        self.step = step
        self.cause = cause
        super().__init__(
            f"rank {rank} went FAILED in {trigger} (epoch {epoch}, in {step or 'guard'}: {cause}) while "
            f"a task waited for {waiting_for}; it will not get there until someone calls "
            "recover(to=...) once it is known what state memory is in."
        )
