"""What one demo run is configured with: the faults to inject and the run's sizes and timeouts."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_fsm.states import Strategy

__all__ = ["FAILING_KINDS", "INJECTION_KINDS", "LAUNCHERS", "MAX_GUARD_TIMEOUT_S", "TRAINERS", "MAX_RANKS", "MAX_STEPS", "DemoConfig", "Injection",
           "fresh_trace_dir"]

#: ``stall`` is a hang after the guard passed, inside the param sync's
#: all-gather: a collective no guard covers, which only the process group's
#: own timeout ends.
INJECTION_KINDS = ("diverge", "hang", "crash", "corrupt", "stall", "undeclared", "leak")
#: The faults that must fail the run; a ``leak`` only warns (the live drift check), and the run goes on.
FAILING_KINDS = tuple(k for k in INJECTION_KINDS if k != "leak")
#: One host runs every rank, each with torch loaded (about 0.3 GB) and its gloo connections.
MAX_RANKS = 64
MAX_STEPS = 100_000
TRAINERS = ("reference", "megatron")
LAUNCHERS = ("local", "ray")
#: A day: a longer wait is a hang by any measure, and larger values overflow the store's timers.
MAX_GUARD_TIMEOUT_S = 86_400.0


#: Faults that stop a rank without an error: only a peer's timeout can notice them.
_STOPS = ("hang", "stall")


def _position(inj: Injection) -> tuple[int, int]:
    """When a fault strikes within the run: its step, then hang (before the guard), the others, stall (last)."""
    return (inj.step, {"hang": 0, "stall": 2}.get(inj.kind, 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class Injection:
    """One fault: ``kind`` at ``rank`` during RL step ``step`` (1-based)."""

    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> Injection:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in INJECTION_KINDS:
            raise ValueError(f"expected KIND:RANK:STEP with KIND in {'|'.join(INJECTION_KINDS)}, got {text!r}")
        try:
            rank, step = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"RANK and STEP must be integers, got {text!r}") from None
        return cls(kind=parts[0], rank=rank, step=step)

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.step}"


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Everything one demo run is configured with."""

    ranks: int = 2
    steps: int = 4
    mode: Strategy = Strategy.REMATERIALIZE
    trace_dir: Path = field(default_factory=lambda: fresh_trace_dir(Path("miles-fsm-traces")))
    injections: tuple[Injection, ...] = ()
    #: The plan audit on verified cycles (the demo verifies every cycle); False lets an
    #: ``undeclared`` injection hang the ranks, for replay ``--flight-recorder`` to explain.
    audit: bool = True
    guard_timeout_s: float = 10.0
    layers: int = 2
    dim: int = 32
    heads: int = 2
    vocab: int = 64
    max_seq: int = 32
    batch: int = 4
    prompt_len: int = 4
    new_tokens: int = 8
    #: ``reference`` (the pure-torch trainer and engine) or ``megatron`` (real megatron-core on CPU, no engine).
    trainer: str = "reference"
    #: ``local`` (processes from a forkserver) or ``ray`` (Ray actors).
    launcher: str = "local"

    def problems(self) -> list[str]:
        out = []
        if not 1 <= self.ranks <= MAX_RANKS:
            out.append(f"--ranks must be in 1..{MAX_RANKS} (every rank runs on this host), got {self.ranks}")
        if not 1 <= self.steps <= MAX_STEPS:
            out.append(f"--steps must be in 1..{MAX_STEPS}, got {self.steps}")
        if not (math.isfinite(self.guard_timeout_s) and 0 < self.guard_timeout_s <= MAX_GUARD_TIMEOUT_S):
            out.append(
                f"--guard-timeout must be finite, > 0 and <= {MAX_GUARD_TIMEOUT_S:.0f} s, got {self.guard_timeout_s}"
            )
        for inj in self.injections:
            if not 0 <= inj.rank < self.ranks:
                out.append(f"--inject {inj}: rank must be in 0..{self.ranks - 1}")
            if not 1 <= inj.step <= self.steps:
                out.append(f"--inject {inj}: step must be in 1..{self.steps}")
            if inj.kind in ("hang", "diverge", "stall", "undeclared") and self.ranks < 2:
                out.append(f"--inject {inj}: needs --ranks >= 2 (only a peer's guard can notice it)")
        stuck = self._no_rank_left()
        if stuck:
            out.append(stuck)
        if self.layers < 1 or self.dim < 1 or self.heads < 1 or self.dim % self.heads:
            out.append(f"--layers and --dim must be >= 1, --dim a multiple of {self.heads} heads")
        if self.trainer not in TRAINERS:
            out.append(f"--trainer must be one of {'|'.join(TRAINERS)}, got {self.trainer!r}")
        elif self.trainer == "megatron" and self.injections:
            out.append("--inject runs with --trainer reference only (its faults are the reference trainer's)")
        if self.launcher not in LAUNCHERS:
            out.append(f"--launcher must be one of {'|'.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.prompt_len + self.new_tokens > self.max_seq:
            out.append(f"prompt_len + new_tokens must be <= max_seq ({self.max_seq})")
        return out

    def _no_rank_left(self) -> str | None:
        """A problem when every rank stops at one point, and no rank is left waiting on a timer to notice.

        Only a rank waiting at a guard or in a collective times out and names
        the others. Within a step, a ``hang`` stops a rank before its first
        guard, the other faults strike in its steps, and a ``stall`` stops it
        in its train step, after them; one fault per rank and step is armed
        (the last given). The run ends by itself exactly when the earliest of
        them is not a stop that every rank shares. Refused rather than bounded
        at run time: the demo cannot tell a rank that stopped for good from
        one that is slow (a large model's step), but here it knows in advance.
        """
        armed = {(i.rank, i.step): i for i in self.injections if 0 <= i.rank < self.ranks}
        if not armed or self.ranks < 2:
            return None
        first = min(armed.values(), key=_position)
        if first.kind not in _STOPS:
            return None
        stopped = [i for i in armed.values() if _position(i) == _position(first)]
        if len(stopped) < self.ranks:
            return None
        where = "before its first guard" if first.kind == "hang" else "in its train step"
        return (f"--inject {' '.join(str(i) for i in sorted(stopped, key=lambda i: i.rank))}: every rank stops "
                f"{where} at step {first.step}, so no rank is left to wait at a guard, time out and name them; "
                "leave at least one rank out (its guard then names the others)")  # fmt: skip

    @property
    def pg_timeout_s(self) -> float:
        """Timeout of the trainers' own collectives: a hang inside one still ends in time.

        The brief's contract: every rank is out within the guard timeout plus
        10 s of a fault. A hang inside a collective costs this timeout, then
        the survivors' search for a culprit (``locate``, at most 1 s), the
        linger for the hung rank (``linger_s``) and its kill: G + 2 + 1 + 3.5
        leaves 3.5 s of the contract for a loaded host. A healthy collective
        never waits long: the guard before it made every rank arrive together.
        """
        return self.guard_timeout_s + 2.0

    @property
    def linger_s(self) -> float:
        """Once a rank failed, how long the others get to report before they are killed.

        A survivor may need the guard's wait for a lost peer's arrival (2 s,
        ``miles_fsm.guard.consensus``) plus its own ``locate`` (at most 1 s) before it
        can report; a linger shorter than that kills it with its report
        unwritten, and its error never names the culprit.
        """
        return 3.5

    @property
    def run_timeout_s(self) -> float:
        return 60.0 + 20.0 * self.steps * max(1, self.ranks // 2) + 2 * self.guard_timeout_s

    def to_kwargs(self) -> dict[str, Any]:
        """Plain data for the rank processes."""
        return {
            "mode": self.mode.value,
            "steps": self.steps,
            "trace_dir": str(self.trace_dir),
            "injections": [(i.kind, i.rank, i.step) for i in self.injections],
            "guard_timeout_s": self.guard_timeout_s,
            "audit": self.audit,
            "model": {k: getattr(self, k) for k in ("vocab", "dim", "layers", "heads", "max_seq")},
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
        }


def fresh_trace_dir(root: Path) -> Path:
    """A timestamped directory under ``root`` that does not exist yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        if not path.exists():
            return path
    raise FileExistsError(f"no fresh trace directory under {root}")
