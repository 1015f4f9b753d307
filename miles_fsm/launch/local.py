"""Run a function on N local ranks over gloo, and always clean up.

The parent hosts the TCPStore, so the store outlives any rank that dies and
the survivors can still name it. Children start from a forkserver that has
torch imported already. Every exit path (return, timeout, Ctrl-C, SIGTERM or
SIGHUP, an exception in the parent) kills every child that is still alive.

How ranks are stopped, by the launcher or on their own when it dies, is
``miles_fsm.launch.stopping``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from miles_fsm.errors import MilesFsmError, RankRaisedError, crosses, message_of, plain
from miles_fsm.launch.stopping import (
    EXIT_LAUNCHER_LOST,
    EXIT_STOPPED,
    LauncherLostError,
    LaunchInterrupted,
    RankSignalledError,
    RankStoppedError,
    StopError,
    StopReason,
    block_stop_signals,
    is_stopped,
    set_parent_death_signal,
    stop_on_termination,
    stop_ranks,
    watch_launcher,
    watch_stop_signals,
)

__all__ = [
    "EXIT_LAUNCHER_LOST",
    "EXIT_STOPPED",
    "LaunchInterrupted",
    "LauncherLostError",
    "RankContext",
    "RankError",
    "RankOutcome",
    "RankSignalledError",
    "RankStoppedError",
    "StopReason",
    "flatten_error",
    "run_ranks",
]

@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function receives."""

    rank: int
    world: int
    kwargs: Mapping[str, Any]
    _on_stop: list[tuple[bool, Callable[[Any], None]]] = field(default_factory=list, repr=False, compare=False)

    def on_stopped(self, callback: Callable[[StopError], None]) -> None:
        """Run ``callback`` (from a watchdog thread) if the rank is stopped from outside; then it exits.

        It gets ``RankStoppedError`` when the launcher stops the rank (a
        signal, the run's timeout, another rank's failure),
        ``LauncherLostError`` when the launcher died, and
        ``RankSignalledError`` when SIGTERM or SIGHUP reached this rank alone. The main thread may be
        anywhere, a collective included. The callback must be quick and must
        not touch collectives or the store: the store lives in the launcher,
        and peers may be gone. Write the last trace record.
        """
        self._on_stop.append((False, callback))

    def on_launcher_lost(self, callback: Callable[[LauncherLostError], None]) -> None:
        """Run ``callback`` (from a watchdog thread) only if the launcher dies; see ``on_stopped``."""
        self._on_stop.append((True, callback))


@dataclass(frozen=True, slots=True)
class RankError:
    """An exception a rank raised, flattened so it crosses the process boundary."""

    type: str
    message: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """How one rank ended: its return value, its error, or neither (killed).

    ``killed``: the launcher stopped it (its run timed out, or it outlived
    the linger after another rank failed), as opposed to dying on its own.
    """

    rank: int
    exitcode: int | None
    result: Any = None
    error: RankError | None = None
    elapsed_s: float | None = None
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def flatten_error(exc: BaseException) -> RankError:
    """An exception as a ``RankError``: its type, message, fields (a miles-fsm error's) and traceback."""
    if isinstance(exc, RankRaisedError):  # a stand-in for an error that could not cross: say what it stands for
        return RankError(exc.type_name, exc.message, {"rank": exc.rank}, exc.traceback_text)
    # A miles-fsm error's facts are its fields; other errors carry none. A fact that cannot
    # cross the process boundary crosses as its plain (JSON-ready) form, so the outcome still does.
    attrs = {k: v if crosses(v) else plain(v) for k, v in exc.fields().items() if v is not None} \
        if isinstance(exc, MilesFsmError) else {}  # fmt: skip
    return RankError(type(exc).__name__, message_of(exc), attrs, "".join(traceback.format_exception(exc)))


def _child(
    fn: Callable[[RankContext], Any],
    rank: int,
    world: int,
    port: int,
    kwargs: Mapping[str, Any],
    results: Any,
    pg_timeout_s: float,
    control: Any,
    launcher_pid: int,
    mp_tmp: str | None,
    env: Mapping[str, str] | None = None,
) -> None:
    block_stop_signals()  # before any thread starts: every thread inherits it
    set_parent_death_signal()
    # The launcher stops ranks and says why (the control pipe): a terminal's Ctrl-C reaches every
    # process of its group at once, and a rank that raised KeyboardInterrupt on its own would read
    # as a rank that failed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before the process group exists: torch reads some settings (the Flight Recorder's) only then.
    os.environ.update(env or {})
    ctx = RankContext(rank=rank, world=world, kwargs=kwargs)
    # First, before anything that could block on the launcher (the store lives there).
    threading.Thread(
        target=watch_launcher, args=(control, ctx, launcher_pid, mp_tmp), name="miles-fsm-launcher-watch",
        daemon=True,
    ).start()
    threading.Thread(target=watch_stop_signals, args=(ctx,), name="miles-fsm-signal-watch", daemon=True).start()

    import torch.distributed as dist

    started = time.monotonic()
    timeout = timedelta(seconds=pg_timeout_s)
    try:
        # Joining is part of the rank's work: a failure to join is reported like any other, never
        # printed as a traceback by multiprocessing on its way out.
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = fn(ctx)
    except BaseException as exc:  # reported to the parent, then the child exits non-zero
        results.put((rank, None, flatten_error(exc), time.monotonic() - started))
        results.close()
        results.join_thread()
        os._exit(1)
    results.put((rank, result, None, time.monotonic() - started))
    results.close()
    results.join_thread()
    dist.destroy_process_group()


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # The last one makes the forkserver outlive a signal to the process group (its docstring says why).
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "miles_fsm.launch.local",
                                     "miles_fsm.launch.forkserver"])
    return _CTX


def run_ranks(
    fn: Callable[[RankContext], Any],
    world: int,
    *,
    timeout_s: float,
    kwargs: Mapping[str, Any] | None = None,
    pg_timeout_s: float | None = None,
    on_result: Callable[[RankOutcome], None] | None = None,
    linger_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[RankOutcome]:
    """Run ``fn`` on ranks ``0..world-1`` and return one outcome per rank.

    ``fn`` must be importable by name (a module-level function). Ranks still
    alive after ``timeout_s`` are killed and reported with no result.
    ``pg_timeout_s`` is the default process group's timeout (default:
    ``timeout_s``). ``on_result`` sees each rank's outcome as it arrives.
    ``linger_s``: once a rank has failed, the others get this long to finish
    (and report their own errors) before they are killed; a rank hung in a
    collective would otherwise hold the run until ``timeout_s``.
    ``env``: variables set in each rank before its process group is made
    (e.g. ``TORCH_FR_BUFFER_SIZE``, which torch reads only then).

    SIGTERM or SIGHUP while it runs stop every rank, then raise
    ``LaunchInterrupted`` (a ``KeyboardInterrupt``); Ctrl-C stops every
    rank, then raises ``KeyboardInterrupt``. Every rank stopped while still
    running is told why first (``RankContext.on_stopped`` gets a
    ``RankStoppedError``). If this process dies without cleaning up, each
    rank notices and exits on its own (``LauncherLostError``).
    """
    from multiprocessing import util

    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    controls = [ctx.Pipe(duplex=False) for _ in range(world)]  # (rank's read end, this process's write end)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world, store.port, dict(kwargs or {}), results, pg_timeout_s or timeout_s, controls[r][0],
                  os.getpid(), util.get_temp_dir(), dict(env or {})),
            name=f"miles-fsm-rank-{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    outcomes: dict[int, RankOutcome] = {}
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    why: dict[str, Any] = {"reason": StopReason.LAUNCHER_ERROR}
    try:
        with stop_on_termination():
            try:
                for p in procs:
                    p.start()
                for read_end, _ in controls:
                    read_end.close()  # each rank holds its read end; this process, the only write end
                _collect(procs, results, outcomes, on_result, deadline, linger_s)
                _drain(results, procs, outcomes, on_result)
                failed = sorted(r for r, o in outcomes.items() if not o.ok)
                why = {"reason": StopReason.PEER_FAILED, "failed": failed} if failed else {"reason": StopReason.TIMEOUT}
            except KeyboardInterrupt as exc:  # Ctrl-C, or LaunchInterrupted (SIGTERM, SIGHUP)
                why = {"reason": StopReason.SIGNAL,
                       "signal": signal.Signals(getattr(exc, "signum", signal.SIGINT)).name}  # fmt: skip
                raise
            finally:
                killed = stop_ranks(procs, [write_end for _, write_end in controls], why)
    finally:
        results.close()
        results.cancel_join_thread()
        for _, write_end in controls:
            write_end.close()  # after every rank is gone: none of them may read it as the launcher's death
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, p.exitcode, killed=r in killed)
            if on_result is not None:
                on_result(outcomes[r])
    return [outcomes[r] for r in range(world)]


def _collect(
    procs: list[Any], results: Any, outcomes: dict[int, RankOutcome], on_result: Any, deadline: float,
    linger_s: float | None,
) -> None:
    world = len(procs)
    lingering = False
    while len(outcomes) < world and time.monotonic() < deadline:
        try:
            rank, result, error, elapsed = results.get(timeout=0.1)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                return  # everyone is gone; the caller drains what is left
            if lingering and _none_can_report(procs, outcomes):
                return  # the linger is for ranks that may still report: a stopped one never will
            continue
        procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
        outcomes[rank] = RankOutcome(rank, procs[rank].exitcode, result, error, elapsed)
        if on_result is not None:
            on_result(outcomes[rank])
        if linger_s is not None and not outcomes[rank].ok:
            deadline = min(deadline, time.monotonic() + linger_s)
            lingering = True


def _none_can_report(procs: list[Any], outcomes: dict[int, RankOutcome]) -> bool:
    """Every rank yet to report is gone or stopped (SIGSTOP: it runs nothing until continued)."""
    return all(not p.is_alive() or is_stopped(p.pid) for r, p in enumerate(procs) if r not in outcomes)


def _drain(results: Any, procs: list[Any], outcomes: dict[int, RankOutcome], on_result: Any) -> None:
    while True:
        try:
            rank, result, error, elapsed = results.get(timeout=0.05)
        except queue.Empty:
            return
        procs[rank].join(timeout=1.0)
        outcomes[rank] = RankOutcome(rank, procs[rank].exitcode, result, error, elapsed)
        if on_result is not None:
            on_result(outcomes[rank])
