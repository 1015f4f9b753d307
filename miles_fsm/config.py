"""Small frozen configs, one per component, passed as keyword arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from miles_fsm.errors import ConfigError

__all__ = ["GuardConfig", "LifecycleConfig", "VerifyConfig", "ci_mode"]


def ci_mode() -> bool:
    """True under CI (``CI=true``), where verification runs every cycle."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """How long a rank waits at a guard for the others."""

    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError([f"guard timeout_s must be > 0, got {self.timeout_s!r}"], "GuardConfig")


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyConfig:
    """SHA256 verification of every tensor across an offload/wake cycle.

    ``cycles`` is how many cycles are verified from the start; None means
    every cycle. ``CI=true`` in the environment also means every cycle,
    unless ``ci_verifies_every_cycle`` is False (a benchmark that must time
    unverified cycles).
    """

    cycles: int | None = 2
    threads: int | None = None
    ci_verifies_every_cycle: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.cycles is not None and self.cycles < 0:
            problems.append(f"cycles must be >= 0 or None, got {self.cycles!r}")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads must be >= 1 or None, got {self.threads!r}")
        if problems:
            raise ConfigError(problems, "VerifyConfig")

    def active(self, epoch: int) -> bool:
        """Whether cycle ``epoch`` (1-based) is verified."""
        return self.cycles is None or epoch <= self.cycles or (self.ci_verifies_every_cycle and ci_mode())


@dataclass(frozen=True, kw_only=True, slots=True)
class LifecycleConfig:
    """Everything a ``Lifecycle`` is configured with."""

    guard: GuardConfig = field(default_factory=GuardConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    trace_dir: Path | None = None
    #: The run's id in every trace record; None: ``MILES_FSM_RUN_ID``, else
    #: made by rank 0 and shared with every rank when the lifecycle is built.
    run_id: str | None = None
