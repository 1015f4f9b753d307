"""``miles-fsm demo``: the whole colocated loop on the embedded default, on CPU.

N gloo ranks (``miles_fsm.launch.run_ranks``: the parent hosts the store and
always kills its children) each run K RL steps of the reference trainer and
engine through a ``Lifecycle``::

    offload -> pause (push weights) -> generate -> rematerialize -> sync
    -> resume (verify) -> train

Every cycle is verified bit-exact (params and optimizer state against their
pre-offload SHA256, engine weights against the pushed ones). The training
step sits behind the same consensus guard as the lifecycle's collectives.

``--inject KIND:RANK:STEP`` breaks one rank on purpose; the run must then end
non-zero, quickly, naming that rank:

- ``diverge``: the rank believes a param is frozen (outside its buffers), so
  its planned tensor set and collectives differ -> ``RankDivergenceError``;
- ``hang``: the rank stops before its guard -> the others time out naming it;
- ``crash``: the rank SIGKILLs itself inside ``param_sync`` (``restore`` under
  backup) -> the others lose it, in the all-gather or at their next guard;
- ``corrupt``: a bit flips in the rank's master shard before its restore ->
  ``VerificationError``, traced back to the shard's owner.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from miles_fsm.launch import RankContext, RankOutcome, run_ranks
from miles_fsm.states import Strategy
from miles_fsm.tracing import trace_path

__all__ = [
    "INJECTION_KINDS",
    "DemoConfig",
    "DemoResult",
    "Injection",
    "add_parser",
    "demo_trainer_cls",
    "print_result",
    "run_demo",
]

INJECTION_KINDS = ("diverge", "hang", "crash", "corrupt")

#: What a ``diverge`` rank wrongly believes is frozen (outside its buffers).
DIVERGE_PARAM = "pos.weight"

_PID_KEY = "miles_fsm/demo/pid/"
#: How long a failed rank looks for the peer to blame before giving up.
_LOCATE_GRACE_S = 2.0
_ROWS = ("start", "offload", "pause", "generate", "rematerialize", "sync", "resume", "train")


@dataclass(frozen=True, kw_only=True, slots=True)
class Injection:
    """One fault: ``kind`` at ``rank`` during RL step ``step`` (1-based)."""

    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> "Injection":
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
    trace_dir: Path = field(default_factory=lambda: _fresh_trace_dir(Path("miles-fsm-traces")))
    injections: tuple[Injection, ...] = ()
    guard_timeout_s: float = 10.0
    layers: int = 2
    dim: int = 32
    heads: int = 2
    vocab: int = 64
    max_seq: int = 32
    batch: int = 4
    prompt_len: int = 4
    new_tokens: int = 8

    def problems(self) -> list[str]:
        out = []
        if self.ranks < 1:
            out.append(f"--ranks must be >= 1, got {self.ranks}")
        if self.steps < 1:
            out.append(f"--steps must be >= 1, got {self.steps}")
        if not self.guard_timeout_s > 0:
            out.append(f"--guard-timeout must be > 0, got {self.guard_timeout_s}")
        for inj in self.injections:
            if not 0 <= inj.rank < self.ranks:
                out.append(f"--inject {inj}: rank must be in 0..{self.ranks - 1}")
            if not 1 <= inj.step <= self.steps:
                out.append(f"--inject {inj}: step must be in 1..{self.steps}")
            if inj.kind in ("hang", "diverge") and self.ranks < 2:
                out.append(f"--inject {inj}: needs --ranks >= 2 (only a peer's guard can notice it)")
        if self.layers < 1 or self.dim < 1 or self.heads < 1 or self.dim % self.heads:
            out.append(f"--layers and --dim must be >= 1, --dim a multiple of {self.heads} heads")
        if self.prompt_len + self.new_tokens > self.max_seq:
            out.append(f"prompt_len + new_tokens must be <= max_seq ({self.max_seq})")
        return out

    @property
    def pg_timeout_s(self) -> float:
        """Timeout of the trainers' own collectives: a hang inside one still ends in time."""
        return self.guard_timeout_s + 5.0

    @property
    def linger_s(self) -> float:
        """Once a rank failed, how long the others get to report before they are killed."""
        return 2.0

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
            "model": {k: getattr(self, k) for k in ("vocab", "dim", "layers", "heads", "max_seq")},
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
        }


def _fresh_trace_dir(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        if not path.exists():
            return path
    raise FileExistsError(f"no fresh trace directory under {root}")


# =============================================================== rank side


def _rank_main(ctx: RankContext) -> dict[str, Any]:
    """One rank of the demo; runs in a child process started by ``run_ranks``."""
    import torch
    import torch.distributed as dist

    from miles_fsm.config import GuardConfig, LifecycleConfig, VerifyConfig
    from miles_fsm.drivers.cpu_memory import CpuMemorySaver
    from miles_fsm.drivers.reference import ModelConfig, TrainerConfig
    from miles_fsm.drivers.reference_engine import EngineConfig, ReferenceEngine
    from miles_fsm.guard import Guard
    from miles_fsm.states.lifecycle import Lifecycle
    from miles_fsm.states import State, Trigger

    kw = ctx.kwargs
    rank, world = ctx.rank, ctx.world
    # N ranks share the host's cores; more intra-op threads than that only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mode = Strategy(kw["mode"])
    model = ModelConfig(**kw["model"])
    arms = {step: kind for kind, r, step in kw["injections"] if r == rank}
    if world > 1:
        dist.distributed_c10d._get_default_store().set(f"{_PID_KEY}{rank}", str(os.getpid()))

    saver = CpuMemorySaver()  # one "device": trainer and engine share it, as they share a GPU
    trainer = demo_trainer_cls()(config=TrainerConfig(model=model, strategy=mode), saver=saver)
    engine = ReferenceEngine(config=EngineConfig(model=model, max_batch=kw["batch"]), saver=saver)
    guard = Guard.from_default_group(timeout_s=kw["guard_timeout_s"])
    lc = Lifecycle(
        trainer=trainer,
        engine=engine,
        config=LifecycleConfig(
            guard=GuardConfig(timeout_s=kw["guard_timeout_s"]),
            verify=VerifyConfig(cycles=None),
            trace_dir=Path(kw["trace_dir"]),
        ),
        guard=guard,
        trace_meta={"demo": {"steps": kw["steps"], "injections": [":".join(map(str, i)) for i in kw["injections"]]}},
    )
    rows: list[dict[str, Any]] = []
    held: dict[str, int] = {}
    verified: list[int] = []

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        saver.reset_peak()
        t0 = time.perf_counter()
        out = fn()
        rows.append(
            {
                "name": name,
                "epoch": lc.epoch,
                "duration_s": time.perf_counter() - t0,
                "bytes_moved": getattr(out, "bytes_moved", None),
                "peak_bytes": saver.peak_bytes(),
                "host_bytes": trainer.backup_host_bytes() + saver.host_bytes(),
            }
        )
        return out

    where = "start"
    with lc:
        try:
            timed("start", lc.start)
            for step in range(1, kw["steps"] + 1):
                trainer.armed = arms.get(step)
                hang = _hang_forever if trainer.armed == "hang" else None
                where = "offload"
                timed("offload", lambda: lc.fire(Trigger.OFFLOAD, before_guard=hang))
                where = "pause"
                timed("pause", lc.pause)
                held = {
                    "actor": trainer.backup_host_bytes("actor"),
                    "actor_bf16_params": trainer.host_bf16_param_bytes(),
                    "ref": trainer.backup_host_bytes("ref"),
                    "saver_backups": saver.host_bytes(),
                    "bf16_params": sum(t.numel() * 2 for t in trainer.params.values()),
                }
                where = "generate"
                gen = torch.Generator().manual_seed(1000 * step + rank)
                prompts = torch.randint(0, model.vocab, (kw["batch"], kw["prompt_len"]), generator=gen)
                rollouts = timed("generate", lambda: engine.generate(prompts, max_new_tokens=kw["new_tokens"]))
                for name, trig in (("rematerialize", Trigger.REMATERIALIZE), ("sync", Trigger.SYNC),
                                   ("resume", Trigger.RESUME)):
                    where = name
                    timed(name, lambda t=trig: lc.fire(t))
                verified.append(lc.epoch)
                where = "train"
                loss = timed("train", lambda: _guarded_train(lc, trainer, rollouts, kw["prompt_len"]))
                lc.tracer.emit("demo_step", epoch=lc.epoch, state=lc.state.value, trigger=None, step=step, loss=loss)
        except Exception as exc:  # re-raised below, with the culprit named when the evidence allows
            if lc.state is not State.FAILED and world > 1:  # the lifecycle publishes its own failures
                guard.publish_failure(lc.epoch, where, lc.state.value, f"failed in {where} of")
            located = _locate(exc, rank=rank, world=world, guard=guard, trainer=trainer)
            lc.tracer.emit(
                "demo_failed",
                epoch=lc.epoch,
                state=lc.state.value,
                trigger=None,
                where=where,
                error=type(exc).__name__,
                message=str(exc),
                culprits=list(located.culprits) if located is not None else None,
            )
            if located is not None:
                raise located from exc
            raise
    return {"rows": rows, "verified": verified, "held": held, "weights": len(trainer.weights())}


def _hang_forever() -> None:
    threading.Event().wait()


def _guarded_train(lc: Any, trainer: Any, rollouts: Any, prompt_len: int) -> float:
    """The train step behind the consensus guard: its collectives are agreed on first."""
    lc.agree_on("train", trainer.train_collectives())
    reward = (rollouts[:, prompt_len:] % 2 == 0).float().sum(dim=1)
    return trainer.train_step(rollouts, reward - reward.mean(), prompt_len=prompt_len)


def _locate(exc: BaseException, *, rank: int, world: int, guard: Any, trainer: Any) -> Exception | None:
    """A ``FaultLocatedError`` naming the culprit, when ``exc`` does not name one itself.

    Evidence, in order: tensors that failed verification map to the ranks
    whose master shard they come from; the store says which peers published
    a failure; /proc says which peers' processes are gone.
    """
    from miles_fsm.apps.errors import FaultLocatedError
    from miles_fsm.states.errors import VerificationError

    if getattr(exc, "culprits", None) or getattr(exc, "missing", None):
        return None  # the guard already named it
    text = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
    cause = f"{type(exc).__name__}: {text}"
    if isinstance(exc, VerificationError) and exc.mismatched:
        owners = sorted(trainer.owners(exc.mismatched))
        return FaultLocatedError(
            rank=rank,
            culprits=owners,
            evidence=f"the mismatched tensors ({', '.join(exc.mismatched[:4])}) come from the master-weight "
            f"shard or state of rank(s) {', '.join(map(str, owners))}",
            cause=cause,
        )
    if world == 1:
        return None
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    # A peer's sockets close before its process is gone from /proc: give it a moment.
    deadline = time.monotonic() + _LOCATE_GRACE_S
    while True:
        seen = guard.last_seen()
        failed = {r: s for r, s in seen.items() if r != rank and s is not None and s.phase.startswith("failed")}
        dead = [r for r in range(world) if r != rank and r not in failed and not _alive(store, r)]
        culprits = sorted([*failed, *dead])
        if culprits or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not culprits:
        return None
    evidence = [str(s) for s in failed.values()] + [f"rank {r}: process gone without reporting" for r in dead]
    return FaultLocatedError(rank=rank, culprits=culprits, evidence="; ".join(evidence), cause=cause)


def _alive(store: Any, rank: int) -> bool:
    try:
        pid = int(store.get(f"{_PID_KEY}{rank}"))
    except RuntimeError:  # the store is the parent's; if it is gone we cannot tell
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@functools.cache
def demo_trainer_cls() -> type:
    """``ReferenceTrainer`` plus the demo's faults (built on first use: it imports torch)."""
    from miles_fsm.drivers.reference import ReferenceTrainer
    from miles_fsm.plan import Collective, TensorSet
    from miles_fsm.states import StepKind

    class DemoTrainer(ReferenceTrainer):
        """The reference trainer with the demo's faults, armed for one step at a time."""

        armed: str | None = None

        @property
        def _believed_frozen(self) -> int:
            """Elements this rank wrongly leaves out of its buffer while ``diverge`` is armed."""
            return self.params[DIVERGE_PARAM].numel() if self.armed == "diverge" else 0

        def tensor_set(self) -> TensorSet:
            tensors = super().tensor_set()
            if self.armed != "diverge":
                return tensors
            return TensorSet(tuple(s for s in tensors.specs if s.name != DIVERGE_PARAM))

        def collectives(self, step: Any) -> tuple[Collective, ...]:
            out = super().collectives(step)
            if step.kind is StepKind.PARAM_SYNC:
                out = tuple(Collective(c.op, c.group, c.dtype, c.numel - self._believed_frozen) for c in out)
            return out

        def train_collectives(self) -> tuple[Collective, ...]:
            return tuple(
                Collective(c.op, c.group, c.dtype, c.numel - (self._believed_frozen if c.op != "all_reduce" else 0))
                for c in super().train_collectives()
            )

        def cast_main_to_params(self) -> Any:
            if self.armed == "corrupt":
                self.flip_master_bit()
            return super().cast_main_to_params()

        def param_sync(self) -> Any:
            # After the guard passed: the peers are inside the all-gather with us when we die.
            if self.armed == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().param_sync()

        def restore(self, tag: str) -> Any:
            if self.armed == "crash" and self.strategy is Strategy.BACKUP:  # no param sync under backup
                os.kill(os.getpid(), signal.SIGKILL)
            if self.armed == "corrupt" and self.strategy is Strategy.BACKUP:
                self.flip_master_bit()
            return super().restore(tag)

        def flip_master_bit(self) -> None:
            """Flip the sign bit of one master weight inside a param this rank alone owns."""
            import torch

            name = self.param_within_shard(self.rank)
            start = self.offset_of(name)[0] if name is not None else self.rank * self.shard_numel
            i = start - self.rank * self.shard_numel
            self.main_shard.view(torch.int32)[i : i + 1].bitwise_xor_(torch.tensor([-(2**31)], dtype=torch.int32))

    return DemoTrainer


# ============================================================= parent side


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoResult:
    """How a demo run ended, for the CLI, tests and the benchmark."""

    config: DemoConfig
    outcomes: tuple[RankOutcome, ...]
    wall_s: float
    verified: dict[int, int]
    culprits: tuple[int, ...]
    diagnosis: str

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes) and all(
            self.verified.get(r, 0) == self.config.steps for r in range(self.config.ranks)
        )

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def rows(self) -> list[dict[str, Any]]:
        return [row for o in self.outcomes if o.ok for row in o.result["rows"]]

    def summary(self) -> list[dict[str, Any]]:
        """One row per phase: count, median time, median bytes moved, peak device bytes, max host bytes."""
        out = []
        for name in _ROWS:
            rows = [r for r in self.rows() if r["name"] == name]
            if not rows:
                continue
            moved = [r["bytes_moved"] for r in rows if r["bytes_moved"] is not None]
            out.append(
                {
                    "name": name,
                    "count": len(rows),
                    "median_s": statistics.median(r["duration_s"] for r in rows),
                    "bytes_moved": int(statistics.median(moved)) if moved else None,
                    "peak_bytes": max(r["peak_bytes"] for r in rows),
                    "host_bytes": max(r["host_bytes"] for r in rows),
                }
            )
        return out

    def held(self) -> dict[str, int]:
        """Host bytes held while PAUSED, on rank 0 (every rank holds the same)."""
        return next((o.result["held"] for o in self.outcomes if o.ok), {})


def run_demo(config: DemoConfig, *, out: Any = None) -> DemoResult:
    """Run the demo and print progress to ``out`` (a rich Console; None: quiet)."""
    problems = config.problems()
    if problems:
        from miles_fsm.errors import ConfigError

        raise ConfigError(problems, "demo")
    config.trace_dir.mkdir(parents=True, exist_ok=True)
    watcher = _Progress(config, out) if out is not None else None
    started = time.monotonic()
    if watcher is not None:
        watcher.start()
    try:
        outcomes = run_ranks(
            _rank_main,
            config.ranks,
            timeout_s=config.run_timeout_s,
            kwargs=config.to_kwargs(),
            pg_timeout_s=config.pg_timeout_s,
            linger_s=config.linger_s,
        )
    finally:
        if watcher is not None:
            watcher.stop()
    wall = time.monotonic() - started
    verified = {r: _count_events(trace_path(config.trace_dir, r), "verified") for r in range(config.ranks)}
    culprits, diagnosis = _diagnose(outcomes, config)
    return DemoResult(
        config=config, outcomes=tuple(outcomes), wall_s=wall, verified=verified, culprits=culprits, diagnosis=diagnosis
    )


def _read_trace(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:  # a truncated last line, from a killed rank
            continue
    return out


def _count_events(path: Path, event: str) -> int:
    return sum(1 for r in _read_trace(path) if r.get("event") == event)


def _diagnose(outcomes: Sequence[RankOutcome], config: DemoConfig) -> tuple[tuple[int, ...], str]:
    """Who is to blame and a few lines saying why; from errors, exit codes and traces only."""
    if all(o.ok for o in outcomes):
        return (), ""
    named: Counter[int] = Counter()
    died: list[int] = []
    lines = []
    for o in outcomes:
        if o.error is not None:
            first = o.error.message.splitlines()[0] if o.error.message else ""
            lines.append(f"rank {o.rank}: {o.error.type}: {_clip(first)}")
            for r in o.error.attrs.get("culprits") or o.error.attrs.get("missing") or ():
                named[int(r)] += 1
        elif o.ok:
            lines.append(f"rank {o.rank}: finished")
        else:
            last = _last_record(config.trace_dir, o.rank)
            if o.exitcode is not None and o.exitcode < 0 and -o.exitcode == signal.SIGTERM:
                how = "stopped by the demo after another rank failed: it was blocked or hung"
            else:
                how = f"died without reporting ({_exit_text(o.exitcode)})"
                died.append(o.rank)
            lines.append(f"rank {o.rank}: {how}; its trace ends with {last}")
    if named:
        top = max(named.values())
        culprits = tuple(sorted(r for r, n in named.items() if n == top))
    elif died:
        culprits = tuple(died)
    else:
        culprits = tuple(o.rank for o in outcomes if o.error is not None)
    head = f"culprit: rank {', '.join(map(str, culprits))}" if culprits else "culprit: unknown"
    return culprits, "\n".join([head, *("  " + line for line in lines)])


def _clip(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running when killed"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _last_record(trace_dir: Path, rank: int) -> str:
    records = _read_trace(trace_path(trace_dir, rank))
    if not records:
        return "nothing (no trace)"
    r = records[-1]
    what = r.get("action") or r.get("trigger") or ""
    return f"{r.get('event')} {what} in {r.get('state')} (epoch {r.get('epoch')})".replace("  ", " ")


class _Progress:
    """Follows the ranks' traces from a thread and reports finished steps."""

    def __init__(self, config: DemoConfig, out: Any) -> None:
        self._config = config
        self._out = out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-fsm-demo-progress", daemon=True)
        self._offsets = [0] * config.ranks
        self._done = [0] * config.ranks
        self._reported = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        if not self._out.is_terminal:
            self._poll()
            self._report_plain()

    def _run(self) -> None:
        c = self._config
        if self._out.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[bold]demo[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.description}"), console=self._out, transient=True,
            ) as bar:
                task = bar.add_task("starting ranks", total=c.ranks * c.steps)
                while not self._stop.wait(0.1):
                    note = self._poll()
                    bar.update(task, completed=sum(self._done), description=note or "")
            return
        while not self._stop.wait(0.25):
            self._poll()
            self._report_plain()

    def _report_plain(self) -> None:
        c = self._config
        while self._reported < min(self._done):
            self._reported += 1
            self._out.print(f"step {self._reported}/{c.steps}: verified bit-exact on all {c.ranks} ranks")

    def _poll(self) -> str:
        note = ""
        for r in range(self._config.ranks):
            path = trace_path(self._config.trace_dir, r)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[r])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self._offsets[r] += end
            for line in chunk[:end].splitlines():
                rec = orjson.loads(line)
                if rec.get("event") == "demo_step":
                    self._done[r] += 1
                elif rec.get("event") in ("transition_failed", "demo_failed"):
                    note = f"rank {r} failed: {rec.get('error')}"
                    if not self._out.is_terminal:
                        self._out.print(f"rank {r}: {rec.get('event')} ({rec.get('error')})", markup=False)
                elif rec.get("event") == "transition_started":
                    note = f"rank {r}: {rec.get('trigger')} (epoch {rec.get('epoch')})"
        return note


# ==================================================================== CLI


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def print_result(result: DemoResult, out: Any) -> None:
    """The summary table (on success) or the diagnosis (on failure), then the trace directory."""
    from rich.table import Table

    c = result.config
    if result.ok:
        table = Table(title=f"miles-fsm demo: {c.ranks} ranks x {c.steps} steps, {c.mode.value}, every cycle verified")
        for col, justify in (("phase", "left"), ("n", "right"), ("median", "right"), ("bytes moved", "right"),
                             ("peak device", "right"), ("host held", "right")):
            table.add_column(col, justify=justify)
        for row in result.summary():
            table.add_row(
                row["name"], str(row["count"]), f"{row['median_s'] * 1e3:.2f} ms", _human(row["bytes_moved"]),
                _human(row["peak_bytes"]), _human(row["host_bytes"]),
            )
        out.print(table)
        h = result.held()
        out.print(
            f"host bytes held while PAUSED ({c.mode.value}), per rank: actor copy {_human(h.get('actor'))} "
            f"(of which bf16 params {_human(h.get('actor_bf16_params'))}; the bf16 params are "
            f"{_human(h.get('bf16_params'))}), ref copy {_human(h.get('ref'))}, "
            f"optimizer-state backup {_human(h.get('saver_backups'))}"
        )
        out.print(f"OK: {sum(result.verified.values())} cycles verified bit-exact in {result.wall_s:.1f} s")
    else:
        out.print(f"FAILED after {result.wall_s:.1f} s; {result.diagnosis}", markup=False)
    out.print(f"traces: {c.trace_dir}  (miles-fsm replay {c.trace_dir})", markup=False)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the colocated loop on the reference trainer and engine (CPU, gloo)",
        description="Spawn N gloo ranks on CPU and run K verified RL steps; optionally inject faults.",
    )
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per rank (default 4)")
    p.add_argument("--mode", choices=[s.value for s in Strategy], default=Strategy.REMATERIALIZE.value)
    p.add_argument("--trace-dir", type=Path, default=None, help="default: ./miles-fsm-traces/<timestamp>")
    p.add_argument(
        "--inject", action="append", default=[], type=_injection, metavar="KIND:RANK:STEP",
        help=f"fault to inject, KIND in {'|'.join(INJECTION_KINDS)}; repeatable",
    )
    p.add_argument("--guard-timeout", type=float, default=10.0, help="seconds a guard waits (default 10)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--dim", type=int, default=32, help="model width (default 32)")
    p.set_defaults(run=_run, _parser=p)


def _injection(text: str) -> Injection:
    try:
        return Injection.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=True)
    config = DemoConfig(
        ranks=args.ranks,
        steps=args.steps,
        mode=Strategy(args.mode),
        trace_dir=args.trace_dir if args.trace_dir is not None else _fresh_trace_dir(Path("miles-fsm-traces")),
        injections=tuple(args.inject),
        guard_timeout_s=args.guard_timeout,
        layers=args.layers,
        dim=args.dim,
    )
    problems = config.problems()
    if problems:
        args._parser.error("; ".join(problems))
    out.print(
        f"miles-fsm demo: {config.ranks} ranks, {config.steps} steps, {config.mode.value}"
        + (f", injecting {', '.join(map(str, config.injections))}" if config.injections else "")
        + f"; traces in {config.trace_dir}"
    )
    try:
        result = run_demo(config, out=out)
    except KeyboardInterrupt:
        out.print(f"interrupted: every rank was stopped; partial traces in {config.trace_dir}")
        return 130
    print_result(result, out)
    return result.exit_code


if __name__ == "__main__":  # pragma: no cover
    from miles_fsm.apps.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
