"""Small frozen configs, one per component, passed as keyword arguments."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from miles_fsm.errors import ConfigError

__all__ = ["AUTO_HOST_CYCLES", "DriftConfig", "GuardConfig", "LifecycleConfig", "VerifyConfig", "ci_mode"]

#: A day: longer is a hang by any measure (and gloo overflows on inf).
_MAX_TIMEOUT_S = 86400.0
#: ``VerifyConfig(cycles="auto")`` verifies this many cycles where digests are hashed on the host.
AUTO_HOST_CYCLES = 2


def ci_mode() -> bool:
    """True under CI (``CI=true``), where verification runs every cycle."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """How the ranks agree before a transition, and how long a rank waits for the others.

    ``every_transition``: guard every transition (one all-reduce of two
    int64 each), so that no rank offloads, pauses or rematerializes on a
    plan the others do not share, or beside a dead peer. False guards only
    transitions whose plan declares a collective (cheaper, and blind to a
    divergence or a lost peer until the next collective).

    ``timeouts``: per-trigger timeouts that replace ``timeout_s`` for that
    trigger's guard, for a guard that waits on slow peers by design (e.g.
    ``{"rematerialize": 1800}`` when rollouts vary in length: the ranks
    reach rematerialize as their generation ends).
    """

    timeout_s: float = 60.0
    every_transition: bool = True
    timeouts: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        for name, value in (("timeout_s", self.timeout_s), *((f"timeouts[{k!r}]", v) for k, v in self.timeouts.items())):
            if not isinstance(value, (int, float)) or not 0 < value <= _MAX_TIMEOUT_S:
                problems.append(f"guard {name} must be > 0 and <= {_MAX_TIMEOUT_S:g} s, got {value!r}")
        if problems:
            raise ConfigError(problems, "GuardConfig")
        object.__setattr__(self, "timeouts", MappingProxyType(dict(self.timeouts)))

    def timeout_for(self, trigger: str) -> float:
        """The guard timeout of ``trigger``."""
        return self.timeouts.get(trigger, self.timeout_s)

    @property
    def longest_s(self) -> float:
        """The longest guard timeout: what the guard's own process group is built with."""
        return max((self.timeout_s, *self.timeouts.values()))


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyConfig:
    """SHA256 verification of every tensor across an offload/wake cycle.

    ``cycles`` is how many cycles are verified from the start; None means
    every cycle. ``"auto"`` (the default) means every cycle where the
    digests are hashed on the GPU (a CUDA host with Triton: on the H200
    megatron bench, 1.5-1.8% of a short verified cycle, docs/benchmarks.md), and the first
    ``AUTO_HOST_CYCLES`` elsewhere, where the host hashes every byte. A
    number limits verification to the first cycles on every host.
    ``CI=true`` in the environment also means every cycle, unless
    ``ci_verifies_every_cycle`` is False (a benchmark that must time
    unverified cycles).

    ``audit``: on verified cycles, compare the collectives each step really
    issued (read from PyTorch's Flight Recorder, which must be on:
    ``TORCH_FR_BUFFER_SIZE`` set before the process group is made) with the
    ones its plan declared; an undeclared one raises
    ``UndeclaredCollectiveError`` before the next transition.
    """

    cycles: int | None | Literal["auto"] = "auto"
    threads: int | None = None
    ci_verifies_every_cycle: bool = True
    audit: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.cycles != "auto" and self.cycles is not None and (
            not isinstance(self.cycles, int) or isinstance(self.cycles, bool) or self.cycles < 0
        ):
            problems.append(f"cycles must be an int >= 0, None or 'auto', got {self.cycles!r}")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads must be >= 1 or None, got {self.threads!r}")
        if problems:
            raise ConfigError(problems, "VerifyConfig")

    def active(self, epoch: int, *, on_device: bool = False) -> bool:
        """Whether cycle ``epoch`` (1-based) is verified; ``on_device``: the digests are hashed on the GPU."""
        if self.cycles == "auto":
            limit = None if on_device else AUTO_HOST_CYCLES
        else:
            limit = self.cycles
        return limit is None or epoch <= limit or (self.ci_verifies_every_cycle and ci_mode())

    def audits(self, epoch: int) -> bool:
        """Whether cycle ``epoch``'s steps are audited against their plans (always under CI)."""
        return self.audit and (self.active(epoch) or ci_mode())


@dataclass(frozen=True, kw_only=True, slots=True)
class DriftConfig:
    """The per-cycle memory drift check (docs/memory-drift.md).

    At every state of every cycle the lifecycle records a memory snapshot
    (device bytes per tag, host bytes per tag, the process RSS). After
    ``warmup_cycles`` cycles, a figure of one state is drift when it rose in
    each of the last ``sustain_cycles`` cycles and by ``abs_bytes`` or more
    over its growth run, however large the figure; or when it stands more than
    ``abs_bytes + rel * baseline`` above its first post-warm-up value
    (``miles_fsm.drift_rule``).
    ``policy``: ``"warn"`` (a ``MemoryDriftWarning`` and a traced record),
    ``"raise"`` (``MemoryDriftError``) or ``"off"`` (snapshots only).
    """

    warmup_cycles: int = 2
    abs_bytes: int = 64 << 20
    rel: float = 0.05
    #: Consecutive cycles a figure must rise in before its growth is drift (its onset included).
    sustain_cycles: int = 3
    policy: Literal["warn", "raise", "off"] = "warn"
    #: Snapshots are traced and kept; False turns the whole check off (nothing measured).
    enabled: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.warmup_cycles, int) or isinstance(self.warmup_cycles, bool) or self.warmup_cycles < 0:
            problems.append(f"warmup_cycles must be an int >= 0, got {self.warmup_cycles!r}")
        if not isinstance(self.abs_bytes, int) or isinstance(self.abs_bytes, bool) or self.abs_bytes < 0:
            problems.append(f"abs_bytes must be an int >= 0, got {self.abs_bytes!r}")
        if not isinstance(self.sustain_cycles, int) or isinstance(self.sustain_cycles, bool) or self.sustain_cycles < 1:
            problems.append(f"sustain_cycles must be an int >= 1, got {self.sustain_cycles!r}")
        if not isinstance(self.rel, (int, float)) or isinstance(self.rel, bool) or not 0 <= self.rel < 100:
            problems.append(f"rel must be a number in [0, 100) (a part of the baseline, 0.05 = 5%), got {self.rel!r}")
        if self.policy not in ("warn", "raise", "off"):
            problems.append(f"policy must be 'warn', 'raise' or 'off', got {self.policy!r}")
        if problems:
            raise ConfigError(problems, "DriftConfig")

    def traced(self) -> dict[str, int | float | str]:
        """What ``trace_opened`` records, so replay judges the run as the live check did."""
        return {f: getattr(self, f) for f in ("warmup_cycles", "abs_bytes", "rel", "sustain_cycles", "policy")}

    @property
    def cycles_to_judge(self) -> int:
        """The fewest cycles a run needs for sustained growth to be judged: warm-up, baseline, then the rises."""
        return self.warmup_cycles + 1 + self.sustain_cycles

    def tolerance(self, baseline: int) -> float:
        """Bytes a figure may grow past ``baseline`` before it is drift."""
        return self.abs_bytes + self.rel * max(baseline, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class LifecycleConfig:
    """Everything a ``Lifecycle`` is configured with."""

    guard: GuardConfig = field(default_factory=GuardConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    trace_dir: Path | None = None
    #: The run's id in every trace record; None: ``MILES_FSM_RUN_ID``, else
    #: made by rank 0 and shared with every rank when the lifecycle is built.
    run_id: str | None = None
    #: This lifecycle's name when a job runs several (``actor``, ``ref``, ``critic``): its traces go
    #: to ``trace_dir/<name>/`` and its guard keeps its own keys in the store.
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not self.name or not self.name.replace("-", "").replace("_", "").isalnum()):
            raise ConfigError([f"name must be letters, digits, '-' and '_', got {self.name!r}"], "LifecycleConfig")
        if self.trace_dir is not None and not isinstance(self.trace_dir, Path):
            object.__setattr__(self, "trace_dir", Path(self.trace_dir))
