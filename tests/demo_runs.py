"""Demo runs shared by the test session: each distinct ``miles-fsm demo`` run happens once.

Several modules check the same run from different sides (the fault matrix its
contract, replay its diagnosis, the flight recorder its audit), and a run
costs seconds of gloo ranks and guard timeouts. ``DemoRuns.get`` runs
``miles-fsm demo`` in-process on first request and hands every later request
for the same sizes, mode and injections the recorded run. What a test would
have measured around the run is recorded at run time: the wall clock when the
last rank was out, the output on both file descriptors, and the processes
still alive 5 s after (the ``assert_no_leftovers`` wait).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import rank_processes
from miles_fsm.apps.demo import DemoResult


@dataclass(frozen=True, kw_only=True)
class DemoRun:
    """One finished ``miles-fsm demo`` run, as every test that shares it sees it."""

    argv: tuple[str, ...]
    trace_dir: Path
    rc: int
    out: str
    err: str
    #: ``time.time()`` when ``main`` returned: run_demo returns once every rank is joined or killed.
    out_at: float
    #: What the run itself returned (None when it ended before run_demo returned, e.g. a usage error).
    result: DemoResult | None
    #: Processes the run started that were still alive 5 s after it returned.
    left: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """What makes two runs the same run."""

    ranks: int = 2
    steps: int = 4
    mode: str = "rematerialize"
    guard_s: float = 10.0
    inject: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command line, leaving off a flag whose value is the CLI's default: a default run runs as typed."""
        defaults = _cli_defaults()
        flags = {"--ranks": (self.ranks, defaults.ranks), "--steps": (self.steps, defaults.steps),
                 "--mode": (self.mode, defaults.mode), "--guard-timeout": (self.guard_s, defaults.guard_timeout)}  # fmt: skip
        argv = [a for flag, (value, default) in flags.items() if value != default for a in (flag, str(value))]
        for spec in self.inject:
            argv += ["--inject", spec]
        return argv

    def name(self) -> str:
        return "-".join([f"r{self.ranks}", f"s{self.steps}", self.mode, f"g{self.guard_s:g}", *self.inject]).replace(
            ":", "_"
        )


def _cli_defaults() -> argparse.Namespace:
    """What ``miles-fsm demo`` runs with when no flag is given, from its own parser."""
    from miles_fsm.apps.demo.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["demo"])


class DemoRuns:
    """The session's demo runs, by spec; a run happens on the first ``get`` of its spec."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._runs: dict[DemoSpec, DemoRun] = {}

    def get(self, **spec: Any) -> DemoRun:
        """The run of ``DemoSpec(**spec)``, run now if this session has not run it yet."""
        key = DemoSpec(**spec)
        if key not in self._runs:
            self._runs[key] = _run(key.argv(), self._root / key.name())
        return self._runs[key]


def _run(argv: list[str], trace_dir: Path) -> DemoRun:
    from miles_fsm.apps.cli import main

    before = rank_processes()
    with _captured() as (out, err), _recording_results() as results:
        rc = main(["demo", "--trace-dir", str(trace_dir), *argv])
        out_at = time.time()
    deadline = time.monotonic() + 5.0
    while (left := rank_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return DemoRun(argv=tuple(argv), trace_dir=trace_dir, rc=rc, out=out.getvalue(), err=err.getvalue(),
                   out_at=out_at, result=results[-1] if results else None, left=frozenset(left))  # fmt: skip


@contextmanager
def _recording_results() -> Iterator[list[DemoResult]]:
    """The DemoResult the CLI's run returns, for the tests that check the result rather than its print."""
    from miles_fsm.apps.demo import cli

    real = cli.run_demo
    results: list[DemoResult] = []

    def recording(*args: object, **kwargs: object) -> DemoResult:
        results.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return results[-1]

    cli.run_demo = recording  # type: ignore[assignment]
    try:
        yield results
    finally:
        cli.run_demo = real


@contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Stdout and stderr of the run, at the file descriptors and at sys.stdout/sys.stderr, as ``capfd``
    takes them; what was captured before (pytest's own capture) is restored after."""
    texts = io.StringIO(), io.StringIO()
    sys.stdout.flush(), sys.stderr.flush()
    saved_sys = sys.stdout, sys.stderr
    saved_fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as f_out, tempfile.TemporaryFile() as f_err:
        try:
            os.dup2(f_out.fileno(), 1), os.dup2(f_err.fileno(), 2)
            sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
            yield texts
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            sys.stdout, sys.stderr = saved_sys
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            os.close(saved_fds[0]), os.close(saved_fds[1])
            for f, text in zip((f_out, f_err), texts):
                f.seek(0)
                text.write(f.read().decode("utf-8", errors="replace"))
