"""How ranks stop: told by their launcher, or on their own when it dies.

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
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_fsm.errors import MilesFsmError, list_ranks

if TYPE_CHECKING:
    from types import FrameType

    from miles_fsm.launch.local import RankContext

__all__ = [
    "EXIT_LAUNCHER_LOST",
    "EXIT_STOPPED",
    "LaunchInterrupted",
    "LauncherLostError",
    "RankSignalledError",
    "RankStoppedError",
    "StopError",
    "StopReason",
    "block_stop_signals",
    "is_stopped",
    "set_parent_death_signal",
    "stop_on_termination",
    "stop_ranks",
    "watch_launcher",
    "watch_stop_signals",
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
#: The signals that stop a rank from outside (``watch_stop_signals``).
_STOP_SIGNALS = frozenset((signal.SIGTERM, signal.SIGHUP))
#: How long a rank that got one waits for its launcher's word, which a signal to the whole group brings.
_SIGNAL_WAIT_S = 1.0
#: Held by the thread that stops the rank: one stop per process, whoever comes first.
_STOPPING = threading.Lock()
#: When the stop began (``time.monotonic()``), set once by the thread that holds ``_STOPPING``.
_stop_began: float | None = None


class LauncherLostError(MilesFsmError, RuntimeError):
    """The process that launched this rank is gone, so nobody will collect it: the rank stops."""

    #: The rank that stopped.
    rank: int
    #: The process id of the launcher that died.
    launcher_pid: int

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

    #: The rank the launcher stopped.
    rank: int
    #: Why the launcher stopped it.
    reason: StopReason
    #: The signal the launcher got (``SIGTERM``), for ``StopReason.SIGNAL``; else None.
    signal: str | None
    #: The ranks whose failure stopped the run, for ``StopReason.PEER_FAILED``.
    failed: tuple[int, ...]

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


class RankSignalledError(MilesFsmError, RuntimeError):
    """This rank got SIGTERM or SIGHUP from outside while its launcher did not stop the run: the rank stops.

    ``signal`` names the signal. A signal to the whole process group reaches
    the launcher too, and reads as ``RankStoppedError`` instead.
    """

    #: The rank that got the signal.
    rank: int
    #: The signal's name (``SIGTERM``, ``SIGHUP``).
    signal: str

    def __init__(self, *, rank: int, signal: str) -> None:
        self.rank = rank
        self.signal = signal
        super().__init__(
            f"rank {rank} got {signal} from outside (sent to this process alone, not to its launcher) and "
            "stopped; its trace ends here, and its peers' errors follow from it. Look for who sent it: a "
            "scheduler, an OOM handler or an operator's kill"
        )


#: What a rank's ``on_stopped`` callbacks get: why it was stopped from outside.
StopError = LauncherLostError | RankStoppedError | RankSignalledError


class LaunchInterrupted(KeyboardInterrupt):
    """The launching process got SIGTERM or SIGHUP: every rank was stopped, like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name}: every rank was stopped")



# ------------------------------------------------------------ in the rank


def set_parent_death_signal() -> None:
    """Die with the parent process (a forkserver that is killed), where Linux offers it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def watch_launcher(control: Any, ctx: RankContext, launcher_pid: int, mp_tmp: str | None) -> None:
    """Block until the launcher says stop, or its end of ``control`` closes; then stop this rank."""
    try:
        said = control.recv()
    except EOFError:
        said = None  # the only writer is the launcher: end-of-file is its death
    if said is not None:
        _stop_rank(ctx, RankStoppedError(rank=ctx.rank, **said))
        return
    error = LauncherLostError(rank=ctx.rank, launcher_pid=launcher_pid)
    try:
        os.write(2, f"miles-fsm: {error}\n".encode())
    except OSError:
        pass  # stderr went with the launcher (a closed pipe): the trace still says it
    _stop_rank(ctx, error, mp_tmp=mp_tmp)


def block_stop_signals() -> None:
    """Hold SIGTERM and SIGHUP in this thread and every thread it starts, for ``watch_stop_signals`` alone.

    Call it first in the rank, before any thread exists. A signal handler
    would run only in the main thread, between bytecodes, never while it
    waits inside a collective; a thread in ``sigwait`` takes the signal
    wherever the main thread is.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    for s in _STOP_SIGNALS:  # the forkserver ignores them (``miles_fsm.launch.forkserver``), and an ignored
        signal.signal(s, signal.SIG_DFL)  # signal never reaches sigwait


def watch_stop_signals(ctx: RankContext) -> None:
    """Take SIGTERM / SIGHUP sent to this rank (held by ``block_stop_signals``), and stop the rank as they say.

    A signal to the whole process group (``timeout``, Slurm, ``docker stop``,
    a closed terminal) reaches the launcher as well, which then tells every
    rank why it stops them (``RankStoppedError``): the rank waits for that
    word for ``_SIGNAL_WAIT_S``. Without it, the signal was this rank's
    alone: it records ``RankSignalledError`` and dies by the signal. A signal
    that comes well after the rank began to stop ends it at once.
    """
    while True:
        signum = signal.sigwait(_STOP_SIGNALS)
        if _STOPPING.locked():
            # A group's signal and its launcher's word are one stop, and either may come first: the stop
            # under way ends the process within its grace. Only a signal well after it began (the
            # launcher's escalation, an operator's second kill) ends the rank at once.
            began = _stop_began
            if began is None or time.monotonic() - began < _SIGNAL_WAIT_S:
                continue
            os._exit(EXIT_STOPPED)
        deadline = time.monotonic() + _SIGNAL_WAIT_S
        while not _STOPPING.locked() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not _STOPPING.locked():
            _stop_rank(ctx, RankSignalledError(rank=ctx.rank, signal=signal.Signals(signum).name), signum=signum)


def _stop_rank(ctx: RankContext, error: StopError, *, mp_tmp: str | None = None, signum: int | None = None) -> None:
    """Run the rank's stop callbacks (at most ``_LOST_GRACE_S``), then end the process; once per process."""
    global _stop_began
    if not _STOPPING.acquire(blocking=False):
        return  # another thread is stopping this rank: it ends the process
    _stop_began = time.monotonic()
    done = threading.Thread(target=_run_callbacks, args=(ctx, error), daemon=True)
    done.start()
    done.join(_LOST_GRACE_S)
    if isinstance(error, LauncherLostError):
        if mp_tmp is not None:
            _remove_mp_tmp(Path(mp_tmp))
        os._exit(EXIT_LAUNCHER_LOST)
    if signum is not None:  # die by the signal, so the exit status says what ended the rank
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.pthread_kill(threading.get_ident(), signum)
    os._exit(EXIT_STOPPED)


def _run_callbacks(ctx: RankContext, error: StopError) -> None:
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


# -------------------------------------------------------- in the launcher


@contextmanager
def stop_on_termination() -> Iterator[None]:
    """SIGTERM / SIGHUP raise ``LaunchInterrupted`` here, so the caller's cleanup runs and kills the ranks.

    Only where the process would otherwise die at once (the default action)
    and only from the main thread, where Python runs signal handlers; an
    application's own handler is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}

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


def is_stopped(pid: int | None) -> bool:
    """True when process ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger's stop): it runs nothing until continued.

    Such a process reads no message and acts on no SIGTERM (both wait for a
    SIGCONT); only SIGKILL ends it. Linux's /proc tells; elsewhere, False.
    """
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stop_ranks(procs: list[Any], controls: list[Any], why: Mapping[str, Any]) -> set[int]:
    """Stop every rank still alive and return them: told why first, then SIGTERM, then SIGKILL.

    A rank told why writes its last trace record and exits on its own within
    ``_STOP_GRACE_S``, even from inside a collective (its watchdog thread
    reads the message); only one that does not is terminated. A stopped rank
    (``is_stopped``) can do neither: it is killed at once, not waited for.
    """
    alive = {r for r, p in enumerate(procs) if p.is_alive()}
    for r in sorted(alive):
        if is_stopped(procs[r].pid):
            os.kill(procs[r].pid, signal.SIGKILL)
    told = set()
    for r in sorted(r for r in alive if procs[r].is_alive() and not is_stopped(procs[r].pid)):
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
            (procs[r].kill if is_stopped(procs[r].pid) else procs[r].terminate)()
    end = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        if p.pid is None:
            continue  # it never started: nothing to stop
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5.0)
    return alive
