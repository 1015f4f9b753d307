"""Shared test fixtures.

Multi-rank tests run real processes over gloo through ``miles_fsm.launch.local``;
``assert_no_leftovers`` checks the process table afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # rank functions import tests' helpers by name

from proctable import live_processes  # noqa: E402 - needs the path above


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a core dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on a GPU host with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def child_pids(pid: int | None = None) -> set[int]:
    """Live descendants of ``pid`` (default: this process), from /proc."""
    root = pid or os.getpid()
    parents = {p.pid: p.ppid for p in live_processes()}
    out: set[int] = set()
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in out:
                out.add(child)
                frontier.append(child)
    return out


def _is_mp_service(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"multiprocessing.forkserver" in cmd or b"multiprocessing.resource_tracker" in cmd


def rank_processes() -> set[int]:
    """Live descendants, except multiprocessing's forkserver and resource tracker,
    which live exactly as long as the pytest process that started them."""
    return {p for p in child_pids() if not _is_mp_service(p)}


@pytest.fixture
def assert_no_leftovers():
    """Fails the test if it leaves any child process (other than the forkserver) alive."""
    before = rank_processes()
    yield
    import time

    deadline = time.monotonic() + 5.0
    while True:
        left = rank_processes() - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {sorted(left)}"


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory):
    """The session's shared ``miles-fsm demo`` runs (``demo_runs.DemoRuns``): each distinct run happens once."""
    from demo_runs import DemoRuns

    return DemoRuns(tmp_path_factory.mktemp("demo-runs"))
