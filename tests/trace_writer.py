"""Writes per-rank traces record by record in the exact layout ``Lifecycle`` writes (schema v2).

Shared by the replay tests: ``RankWriter`` is one rank, ``healthy`` a whole
run. A trace is closed (``trace_closed``) when it is written, as leaving a
lifecycle's ``with`` block does: clean, or unclean with the failure that
left the rank FAILED. A rank stopped with ``stop=`` (killed or hung) is cut
off: its trace gets no ``trace_closed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from miles_fsm.states import CYCLE, DEFINITION, State, Strategy, Trigger, steps_for

__all__ = ["RUN", "SYNC_PLAN", "TENSORS", "RankWriter", "healthy"]

SYNC_PLAN = ["all_gather@dp[192:bfloat16]"]
TENSORS = "a" * 32
RUN = "20261202-101500-4242-a1b2c3"


class RankWriter:
    """Writes one rank's trace in Lifecycle's record layout."""

    def __init__(self, rank: int, world: int, *, wall0: float = 1.8e9, strategy: str = "rematerialize",
                 run: str | None = RUN, verified: int | None = None) -> None:  # fmt: skip
        self.rank, self.world, self.run = rank, world, run
        #: Tensors each ``verify`` step checks, in a ``verified`` record inside it (None: no record, as with
        #: verification off for the cycle).
        self.verified = verified
        self.seq = 0
        self.mono = 10**12 + rank * 7_777_777  # per-rank monotonic origin
        self.wall0 = wall0
        self.state = "INITIAL"
        self.epoch = 0
        self.lines: list[bytes] = []
        self.strategy = strategy
        #: The failure that left the rank FAILED: what its unclean trace_closed carries.
        self.failure: dict[str, Any] | None = None
        self.cut = False
        self.closed = False
        machine = DEFINITION.describe(steps=lambda t: [str(s) for s in steps_for(t, Strategy(strategy))])
        self.emit("trace_opened", state=None, trigger=None, pid=100 + rank, host="h", rotated_to=None,
                  strategy=strategy, guard_timeout_s=5.0, machine=machine)

    def emit(self, event: str, *, state: Any = "<cur>", trigger: Any = None, epoch: int | None = None,
             dt: float = 0.001, **fields: Any) -> None:
        self.mono += int(dt * 1e9)
        head = {"v": 2} if self.run is None else {"v": 2, "run": self.run}
        rec = {**head, "rank": self.rank, "world": self.world, **fields,
               "epoch": self.epoch if epoch is None else epoch,
               "state": self.state if state == "<cur>" else state, "trigger": trigger, "event": event,
               "seq": self.seq, "mono_ns": self.mono, "wall": self.wall0 + self.mono / 1e9}
        self.seq += 1
        self.lines.append(orjson.dumps(rec))

    def transition(self, trigger: str, *, stop: str | None = None, dest: str | None = None,
                   tensors: str = TENSORS, plan: list[str] | None = None, slow: float = 1.0,
                   guard_error: dict[str, Any] | None = None, step_error: dict[str, Any] | None = None,
                   verify_failed: list[str] | None = None, steps: list[str] | None = None) -> None:
        """One transition; ``stop`` ends the trace inside it ("planning", "guard" or an action name)."""
        t = DEFINITION.transition(State(self.state), Trigger(trigger))
        dest = dest or (t.dest.value if t else "TRAINING")
        if steps is None:
            steps = [str(s) for s in steps_for(t, Strategy(self.strategy))] if t else ["backup(actor)"]
        if trigger == "offload":
            self.epoch += 1
        self.emit("transition_started", trigger=trigger, dest=dest, steps=steps)
        if stop == "planning":
            self.cut = True
            return
        base = {"trigger": trigger}
        guard_s = 0.0
        if trigger == "sync":
            self.emit("guard_entered", key=hash((self.epoch, tensors, tuple(plan or SYNC_PLAN))) & (2**62 - 1),
                      collectives=plan or SYNC_PLAN, tensors=tensors, **base)
            if stop == "guard":
                self.cut = True
                return
            if guard_error is not None:
                self.emit("guard_failed", dt=0.5, **guard_error, **base)
                self.fail(source=self.state, action=None, phase="guard", **guard_error, **base)
                return
            guard_s = 0.002
            self.emit("guard_passed", duration_s=guard_s, dt=guard_s, **base)
        work = 0.0
        for step in steps:
            self.emit("action_started", action=step, mem_before=None, **base)
            if stop == step:
                self.cut = True
                return
            if step_error is not None and step == step_error["action"]:
                self.fail(source=self.state, phase="step", **step_error, **base)
                return
            if verify_failed is not None and step == "verify":
                self.emit("verify_failed", tensors=verify_failed, where="trainer", scheme="chunked-sha256/v2", **base)
                self.fail(source=self.state, action="verify", phase="step", error="VerificationError",
                          message=f"{len(verify_failed)} trainer tensor(s) differ", **base)
                return
            if self.verified is not None and step == "verify":
                self.emit("verified", tensors=self.verified, scheme="chunked-sha256/v2", waited_s=0.0, **base)
            d = 0.01 * slow
            work += d
            self.emit("action_finished", action=step, duration_s=d, bytes_moved=None, host_bytes=None,
                      mem_before=None, mem_after=None, dt=d, **base)
        src = self.state
        self.state = dest
        self.emit("transition_finished", source=src, duration_s=work + guard_s, **base)

    def fail(self, **record: Any) -> None:
        """``transition_failed``: the rank is now FAILED."""
        self.emit("transition_failed", state="FAILED", **record)
        self.state = "FAILED"
        self.failure = {k: record[k] for k in ("error", "message", "fields", "transport") if k in record}

    def cycles(self, n: int, **per_trigger: dict[str, Any]) -> None:
        if self.state == "INITIAL":
            self.transition("start")
        for _ in range(n):
            for trig in CYCLE:
                self.transition(trig.value, **per_trigger.get(trig.value, {}))
                if self.state == "FAILED" or self.cut:
                    return

    def train_guard(self, *, stop: bool = False) -> None:
        """The demo's guarded train step (``Lifecycle.agree_on``): a guard outside any transition."""
        self.emit("guard_entered", trigger="train", key=7, collectives=["all_reduce@dp[1:float32]"], tensors=None)
        if stop:
            self.cut = True
            return
        self.emit("guard_passed", trigger="train", duration_s=0.001)

    def close(self, **unclean: Any) -> None:
        """``trace_closed``: clean, or (given ``error``, ``message``, ...) left by an exception."""
        self.emit("trace_closed", trigger=None, clean=not unclean, **unclean)
        self.closed = True

    def write(self, root: Path, *, tail: bytes = b"", close: bool = True) -> Path:
        """Write the file; a rank that was not cut off is closed first (unclean if it is FAILED)."""
        if close and not self.cut and not self.closed:
            self.close(**(self.failure or {}))
        path = root / f"rank-{self.rank}.jsonl"
        path.write_bytes(b"\n".join(self.lines) + b"\n" + tail)
        return path


def healthy(root: Path, world: int = 3, cycles: int = 2, **kw: Any) -> list[RankWriter]:
    """A healthy run: every rank does the same cycles and closes its trace cleanly."""
    writers = [RankWriter(r, world, **kw) for r in range(world)]
    for w in writers:
        w.cycles(cycles)
        w.write(root)
    return writers
