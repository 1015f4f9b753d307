"""Trainer ranks as Ray actors: verified cycles, and the controller receives the typed errors."""

from __future__ import annotations

import pytest

import ranks_engine
from miles_fsm.errors import GuardTimeoutError, RankDivergenceError

ray = pytest.importorskip("ray", reason="needs ray (the 'test' extra installs it)")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_runtime")]


@pytest.fixture(scope="module")
def ray_runtime():
    """One local Ray runtime for the module (it takes seconds to start); nothing of it outlives the module."""
    from conftest import child_pids

    before = child_pids()
    import os
    import sys

    # Actors import the rank functions by name, from the tests' folder too.
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=env)
    yield
    ray.shutdown()
    import time

    deadline = time.monotonic() + 10
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child_pids() - before, f"Ray left processes behind: {sorted(child_pids() - before)}"


def _run(**kwargs):
    from miles_fsm.launch.ray_actors import run_ranks_ray

    return run_ranks_ray(ranks_engine.cycles_or_diverge, 2, timeout_s=90, linger_s=8, kwargs={"timeout_s": 3.0, **kwargs})


def test_two_ray_actors_run_verified_cycles():
    """2 ranks as Ray actors run 2 cycles over gloo and end in TRAINING with identical params."""
    out = _run()
    assert all(o.ok for o in out), [o.error for o in out]
    assert {o.result["state"] for o in out} == {"TRAINING"} and len({o.result["w"] for o in out}) == 1


def test_a_divergence_reaches_the_controller_as_itself():
    """Rank 1 plans another tensor set: the controller gets RankDivergenceError instances, fields intact."""
    out = _run(frozen_rank=1)
    for o in out:
        assert isinstance(o.exception, RankDivergenceError), o
        assert o.exception.field == "tensor set" and o.exception.how == "tie"  # 1 vs 1, the first guard
        assert o.error.attrs["culprits"] == (0, 1)


def test_a_hang_is_named_to_the_controller_by_the_survivor():
    """Rank 1 hangs before its sync guard: rank 0's GuardTimeoutError names it; the hung actor is killed."""
    out = _run(hang_rank=1)
    assert isinstance(out[0].exception, GuardTimeoutError) and out[0].exception.missing == (1,)
    assert out[1].result is None


def test_the_miles_style_actor_example_runs():
    """examples/ray_actor.py: 2 actors whose sleep / update_weights / wake_up drive the lifecycle run 2 verified
    steps and end in TRAINING."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "ray_actor.py"
    ray.shutdown()  # the example starts a runtime of its own
    try:
        proc = subprocess.run([sys.executable, str(example), "--ranks", "2", "--steps", "2"],
                              capture_output=True, text=True, timeout=180)  # fmt: skip
    finally:
        import os

        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("wake_up -> TRAINING" in s and "verified bit-exact" in s for s in steps)


def test_an_unpicklable_exception_reaches_the_controller_as_a_faithful_stand_in():
    """Rank 1 raises an exception that does not pickle: the controller gets a RankRaisedError with its
    type name, message and traceback text, and rank 0's result still comes back."""
    import ranks_live
    from miles_fsm.errors import RankRaisedError
    from miles_fsm.launch.ray_actors import run_ranks_ray

    out = run_ranks_ray(ranks_live.one_raises_unpicklable, 2, timeout_s=90, linger_s=8, kwargs={"bad": 1, "after_s": 0.5})
    assert out[0].ok and out[0].result == {"rank": 0, "fine": True}, out[0]
    exc = out[1].exception
    assert isinstance(exc, RankRaisedError), out[1]
    assert (exc.rank, exc.type_name, exc.message) == (1, "Unpicklable", "rank 1's engine socket broke")
    assert "raise Unpicklable" in exc.traceback_text
    assert out[1].error.type == "Unpicklable" and out[1].error.message == "rank 1's engine socket broke"
