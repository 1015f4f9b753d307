"""torch elastic's error file, so that torchrun's own summary names the rank that failed first.

torchrun gives each worker a path in ``TORCHELASTIC_ERROR_FILE``. A worker
that fails writes its error there (torch's ``ErrorHandler.record_exception``
format: ``{"message": {"message": ..., "extraInfo": {"py_callstack": ...,
"timestamp": ...}}}``), and the agent's summary names the failure with the
earliest timestamp its "Root Cause". A worker that wrote none is dated when
the agent saw it go. In a hang that is wrong: the survivor times out and
exits first, the agent then stops the hung rank, and the survivor reads as
the root cause. So:

- a worker that raises writes its error file (``record_error``), and when
  its error names other ranks as the culprits (``culprits`` or ``missing``),
  tells them so in the store, dated when they failed at the latest: for a
  guard's timeout, when the wait began (``publish_named``);
- a worker that the agent stops (SIGTERM) and that a peer named writes its
  error file, dated then, with the named error and its own stack: where it
  hung (``watch_agent_stop``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import orjson

__all__ = ["ERROR_FILE_ENV", "publish_named", "record_error", "watch_agent_stop"]

#: Where torchrun's agent tells each worker to write its error.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NAMED_KEY = "miles_fsm/torchrun/named/"
#: How long a store request from here may take: the agent hosts the store, and it may be tearing down.
_STORE_TIMEOUT_S = 2.0


def record_error(exc: BaseException) -> None:
    """This worker's error in its error file (call from the ``except`` block: the traceback is the current one)."""
    if os.environ.get(ERROR_FILE_ENV):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def publish_named(exc: BaseException, *, rank: int) -> None:
    """Tell the ranks ``exc`` names as culprits (not this one) that they were named, and when they failed."""
    named = getattr(exc, "culprits", None) or getattr(exc, "missing", None) or ()
    others = sorted({int(r) for r in named} - {rank})
    if not others or rank in {int(r) for r in named}:
        return  # nobody else, or this rank is among the suspects: its own error file says it
    # A rank that never came to a guard failed by the time the wait for it began, at the latest.
    at = time.time() - float(getattr(exc, "timeout_s", 0.0) or 0.0)
    first = str(exc).splitlines()[0] if str(exc) else ""
    store = _store()
    for r in others:
        key = f"{_NAMED_KEY}{r}"
        if not store.check([key]):  # the first rank to name it says when
            store.set(key, orjson.dumps({"by": rank, "at": at, "error": f"{type(exc).__name__}: {first}"}))


def watch_agent_stop(rank: int, main_thread: int) -> None:
    """Wait for SIGTERM (held by ``stopping.block_stop_signals``); write the error file if a peer named this rank.

    Then die of the signal, as the agent expects.
    """
    signum = signal.sigwait({signal.SIGTERM, signal.SIGHUP})
    try:
        _write_named(rank, main_thread)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.pthread_kill(threading.get_ident(), signum)


def _write_named(rank: int, main_thread: int) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        store = _store()
        key = f"{_NAMED_KEY}{rank}"
        if not store.check([key]):
            return  # nobody named this rank: the agent stopped it after another's failure
        named = orjson.loads(store.get(key))
    except (RuntimeError, ValueError, orjson.JSONDecodeError):
        return  # the agent's store is gone already: the agent dates this rank itself
    frame = sys._current_frames().get(main_thread)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    message = f"rank {rank} stopped answering: rank {named.get('by')} named it the culprit ({named.get('error')})"
    # torchrun's summary shows the stack, not the message: the stack ends with it, as a traceback would.
    where = f"where rank {rank}'s main thread was when torchrun's agent stopped it:\n{stack}"
    extra = {"py_callstack": f"{where}{message}", "timestamp": str(int(named.get("at", time.time())))}
    data = {"message": {"message": message, "extraInfo": extra}}
    with open(path, "wb") as f:
        f.write(orjson.dumps(data))


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=_STORE_TIMEOUT_S))  # fmt: skip
