"""Run a function on N local ranks over gloo, and always clean up.

The parent hosts the TCPStore, so the store outlives any rank that dies and
the survivors can still name it. Children start from a forkserver that has
torch imported already. Every exit path (return, timeout, Ctrl-C, SIGTERM or
SIGHUP, an exception in the parent) kills every child that is still alive.

Each rank holds the read end of a pipe of its own whose only writer is the
parent: the rank's control pipe. When the parent stops a rank that is still
running (an operator's Ctrl-C, SIGTERM or SIGHUP; the run's timeout; the
linger after another rank failed) it first writes why down that pipe, so the
rank can say so in its trace (``RankStoppedError``) before it exits, even
while its main thread is blocked inside a collective; only a rank that does
not exit in time is terminated, then killed. Ranks ignore SIGINT: a Ctrl-C
reaches every process of the terminal's group at once, and the launcher, not
each rank on its own, decides how they stop.

A parent that dies without running any of that (SIGKILL, a crash) is seen
the same way: the pipe's end-of-file is the parent's death. The rank then
runs what it registered with ``RankContext.on_stopped`` (the demo closes its
trace with ``LauncherLostError``), removes the launcher's multiprocessing
temp folder that nobody else will, and exits. A rank's parent process is the
forkserver, not the launcher, and the forkserver lives as long as any rank
does, so a parent-death signal alone would never fire; it is set as well,
for a forkserver that is killed.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from miles_fsm.errors import MilesFsmError, RankRaisedError, crosses, list_ranks, message_of, plain

__all__ = [
    "EXIT_LAUNCHER_LOST",
    "EXIT_STOPPED",
    "LaunchInterrupted",
    "LauncherLostError",
    "RankContext",
    "RankError",
    "RankOutcome",
    "RankStoppedError",
    "StopReason",
    "flatten_error",
    "run_ranks",
]

#: A rank's exit code when it stopped because its launcher died.
EXIT_LAUNCHER_LOST = 75
#: A rank's exit code when its launcher stopped it (as a shell reports SIGTERM).
EXIT_STOPPED = 128 + signal.SIGTERM
#: How long a rank's ``on_stopped`` callbacks may run before it exits regardless.
_LOST_GRACE_S = 2.0
#: How long a rank told to stop gets to write its last record and exit: its callbacks' grace plus
#: a loaded host's margin. Only then is it terminated.
_STOP_GRACE_S = _LOST_GRACE_S + 1.0
#: How long a terminated rank gets before it is killed.
_TERM_GRACE_S = 2.0


class LauncherLostError(MilesFsmError, RuntimeError):
    """The process that launched this rank is gone, so nobody will collect it: the rank stops."""

    def __init__(self, *, rank: int, launcher_pid: int) -> None:
        self.rank = rank
        self.launcher_pid = launcher_pid
        super().__init__(
            f"rank {rank}: its launcher (pid {launcher_pid}) died, so the rank stopped without finishing; "
            "its trace ends here. Rerun the job; look for why the launcher was killed (OOM killer, "
            "a scheduler's SIGKILL) in the system log."
        )


class StopReason(str, enum.Enum):
    """Why a launcher stopped a rank that was still running."""

    #: The launcher got SIGINT (Ctrl-C), SIGTERM or SIGHUP: an operator or a scheduler stopped the run.
    SIGNAL = "signal"
    #: The run's own time limit passed.
    TIMEOUT = "timeout"
    #: Another rank failed, and this one did not finish within the linger that followed.
    PEER_FAILED = "peer_failed"
    #: The launching code itself raised (a callback of its own, say).
    LAUNCHER_ERROR = "launcher_error"


class RankStoppedError(MilesFsmError, RuntimeError):
    """The launcher stopped this rank before it finished; the rank did not fail on its own.

    ``reason`` says why (``StopReason``); ``signal`` names the signal the
    launcher got, for ``StopReason.SIGNAL``; ``failed`` the ranks whose
    failure stopped the run, for ``StopReason.PEER_FAILED``.
    """

    def __init__(self, *, rank: int, reason: StopReason | str, signal: str | None = None,
                 failed: Sequence[int] = ()) -> None:  # fmt: skip
        self.rank = rank
        self.reason = StopReason(reason)
        self.signal = signal
        self.failed = tuple(failed)
        why = {
            StopReason.SIGNAL: f"its launcher got {signal} (an operator's Ctrl-C, or a scheduler's stop) and "
            "stopped every rank; no rank failed by that. Rerun or resume the job",
            StopReason.TIMEOUT: "the run's time limit passed while it was still running; if the job was making "
            "progress, give it more time, else replay its traces to see where it stood",
            StopReason.PEER_FAILED: f"rank(s) {list_ranks(self.failed)} failed and this rank did not finish "
            "within the linger that followed; their errors say what went wrong",
            StopReason.LAUNCHER_ERROR: "the launching process raised; its own traceback says why",
        }[self.reason]
        super().__init__(f"rank {rank} was stopped by its launcher: {why}")


class LaunchInterrupted(KeyboardInterrupt):
    """The launching process got SIGTERM or SIGHUP: every rank was stopped, like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name}: every rank was stopped")


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function receives."""

    rank: int
    world: int
    kwargs: Mapping[str, Any]
    _on_stop: list[tuple[bool, Callable[[Any], None]]] = field(default_factory=list, repr=False, compare=False)

    def on_stopped(self, callback: Callable[[LauncherLostError | RankStoppedError], None]) -> None:
        """Run ``callback`` (from a watchdog thread) if the rank is stopped from outside; then it exits.

        It gets ``RankStoppedError`` when the launcher stops the rank (a
        signal, the run's timeout, another rank's failure), and
        ``LauncherLostError`` when the launcher died. The main thread may be
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


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _watch_launcher(control: Any, ctx: RankContext, launcher_pid: int, mp_tmp: str | None) -> None:
    """Block until the launcher says stop, or its end of ``control`` closes; then stop this rank."""
    try:
        said = control.recv()
    except EOFError:
        said = None  # the only writer is the launcher: end-of-file is its death
    error: LauncherLostError | RankStoppedError
    if said is None:
        error = LauncherLostError(rank=ctx.rank, launcher_pid=launcher_pid)
        try:
            os.write(2, f"miles-fsm: {error}\n".encode())
        except OSError:
            pass  # stderr went with the launcher (a closed pipe): the trace still says it
    else:
        error = RankStoppedError(rank=ctx.rank, **said)
    done = threading.Thread(target=_run_callbacks, args=(ctx, error), daemon=True)
    done.start()
    done.join(_LOST_GRACE_S)
    if said is None:
        if mp_tmp is not None:
            _remove_mp_tmp(Path(mp_tmp))
        os._exit(EXIT_LAUNCHER_LOST)
    os._exit(EXIT_STOPPED)


def _run_callbacks(ctx: RankContext, error: LauncherLostError | RankStoppedError) -> None:
    lost = isinstance(error, LauncherLostError)
    for only_if_lost, callback in ctx._on_stop:
        if lost or not only_if_lost:
            callback(error)


def _remove_mp_tmp(path: Path) -> None:
    # The launcher's atexit would have removed it; every rank tries, and the
    # losers of that race find entries already gone.
    import shutil

    if not path.name.startswith("pymp-"):
        return  # never remove a folder that is not multiprocessing's own

    def gone_already(_fn: Any, _path: str, exc_info: Any) -> None:
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(path, onerror=gone_already)


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
    _set_parent_death_signal()
    # The launcher stops ranks and says why (the control pipe): a terminal's Ctrl-C reaches every
    # process of its group at once, and a rank that raised KeyboardInterrupt on its own would read
    # as a rank that failed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before the process group exists: torch reads some settings (the Flight Recorder's) only then.
    os.environ.update(env or {})
    ctx = RankContext(rank=rank, world=world, kwargs=kwargs)
    # First, before anything that could block on the launcher (the store lives there).
    threading.Thread(
        target=_watch_launcher, args=(control, ctx, launcher_pid, mp_tmp), name="miles-fsm-launcher-watch",
        daemon=True,
    ).start()

    import torch.distributed as dist

    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
    )
    try:
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
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "miles_fsm.launch.local"])
    return _CTX


@contextmanager
def _stop_on_termination() -> Iterator[None]:
    """SIGTERM / SIGHUP raise ``LaunchInterrupted`` here, so the caller's cleanup runs and kills the ranks.

    Only where the process would otherwise die at once (the default action)
    and only from the main thread, where Python runs signal handlers; an
    application's own handler is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def interrupted(signum: int, _frame: Any) -> None:
        for s, h in previous.items():  # a second signal is not held back by this one's cleanup
            signal.signal(s, h)
        raise LaunchInterrupted(signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is signal.SIG_DFL:
            previous[s] = signal.signal(s, interrupted)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
    import torch.distributed as dist
    from multiprocessing import util

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
        with _stop_on_termination():
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
                killed = _stop(procs, [write_end for _, write_end in controls], why)
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
    while len(outcomes) < world and time.monotonic() < deadline:
        try:
            rank, result, error, elapsed = results.get(timeout=0.1)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                return  # everyone is gone; the caller drains what is left
            continue
        procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
        outcomes[rank] = RankOutcome(rank, procs[rank].exitcode, result, error, elapsed)
        if on_result is not None:
            on_result(outcomes[rank])
        if linger_s is not None and not outcomes[rank].ok:
            deadline = min(deadline, time.monotonic() + linger_s)


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


def _stop(procs: list[Any], controls: list[Any], why: Mapping[str, Any]) -> set[int]:
    """Stop every rank still alive and return them: told why first, then SIGTERM, then SIGKILL.

    A rank told why writes its last trace record and exits on its own within
    ``_STOP_GRACE_S``, even from inside a collective (its watchdog thread
    reads the message); only one that does not is terminated.
    """
    alive = {r for r, p in enumerate(procs) if p.is_alive()}
    told = set()
    for r in sorted(alive):
        try:
            controls[r].send({k: v.value if isinstance(v, enum.Enum) else v for k, v in why.items()})
        except (BrokenPipeError, ConnectionResetError):
            continue  # the rank exited between the check and the send: nothing left to tell
        told.add(r)
    end = time.monotonic() + (_STOP_GRACE_S if told else 0.0)
    for r in sorted(told):
        procs[r].join(timeout=max(0.0, end - time.monotonic()))
    for r in sorted(alive):
        if procs[r].is_alive():
            procs[r].terminate()
    end = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        if p.pid is None:
            continue  # it never started: nothing to stop
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5.0)
    return alive
