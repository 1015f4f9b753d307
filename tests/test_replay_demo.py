"""``miles-fsm replay`` on traces of the real demo, one run per injection kind.

Each demo run (3 gloo ranks, 2 RL steps, a fault at rank 1 in step 2) is
shared by the tests of this module and test_demo_faults (the session's
``demo_runs``), so every kind costs one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from miles_fsm.apps.cli import main

pytestmark = pytest.mark.slow

RANKS, STEPS, CULPRIT, AT_STEP = 3, 2, 1, 2

#: What replay must say for each injection at rank 1, step 2 (epoch 2): verdict and transition.
EXPECTED = {
    "diverge": ("divergence", "offload"),  # the tensor set differs at the first guard of the step
    "hang": ("stuck", "offload"),  # stops before the offload's guard
    "crash": ("crashed", "sync"),  # SIGKILL inside param_sync
    "corrupt": ("corrupt", "resume"),  # the verify step of resume finds it
}


@pytest.fixture(scope="module")
def demo_traces(demo_runs) -> dict[str, Path]:
    """The demo run once healthy and once per injection kind (shared with test_demo_faults, which checks
    the same runs' contract); their trace directories by kind."""
    dirs = {}
    for kind in ("ok", *EXPECTED):
        inject = () if kind == "ok" else (f"{kind}:{CULPRIT}:{AT_STEP}",)
        run = demo_runs.get(ranks=RANKS, steps=STEPS, guard_s=2.0, inject=inject)
        assert run.result is not None and run.result.ok == (kind == "ok"), run.out + run.err
        assert not run.left, "the demo left processes behind"
        dirs[kind] = run.trace_dir
    return dirs


def replay_json(capsys, trace_dir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", str(trace_dir), "--json", *extra])
    return code, orjson.loads(capsys.readouterr().out)


def test_healthy_demo_trace_is_ok(demo_traces, capsys):
    """A clean demo run replays as ok with exit 0, every rank done in TRAINING, nothing illegal."""
    code, d = replay_json(capsys, demo_traces["ok"])
    assert (code, d["verdict"], d["illegal"], d["stuck"]) == (0, "ok", [], [])
    assert {(r["status"], r["state"], r["epoch"]) for r in d["ranks"]} == {("done", "TRAINING", STEPS)}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_injected_fault_is_diagnosed(demo_traces, capsys, kind):
    """Each injected fault gives its verdict, names rank 1 alone, at epoch 2 and the right transition."""
    verdict, transition = EXPECTED[kind]
    code, d = replay_json(capsys, demo_traces[kind])
    assert code == 3
    assert d["verdict"] == verdict, d["headline"]
    assert d["culprit"]["ranks"] == [CULPRIT], d["headline"]
    assert (d["culprit"]["epoch"], d["culprit"]["transition"]) == (AT_STEP, transition)


def test_divergence_groups_and_field(demo_traces, capsys):
    """The diverging rank is grouped apart on the tensor set, and the guard's own detail is kept."""
    _, d = replay_json(capsys, demo_traces["diverge"])
    f = d["first_divergence"]
    assert f["field"] == "tensors" and f["culprits"] == [CULPRIT]
    assert [g["ranks"] for g in f["groups"]] == [[0, 2], [CULPRIT]]
    assert any("pos.weight" in line for line in f["guard_report"]["detail"])


def test_hang_is_stuck_not_crashed(demo_traces, capsys):
    """The hung rank is stuck inside offload before its guard; the others timed out naming it."""
    _, d = replay_json(capsys, demo_traces["hang"])
    [s] = d["stuck"]
    assert (s["rank"], s["how"], s["state"]) == (CULPRIT, "stuck", "TRAINING")
    assert "before its guard" in s["inside"] and s["accused_by"] == [0, 2]
    assert s["silent_s"] >= 1.0


def test_crash_is_crashed_not_stuck(demo_traces, capsys):
    """The killed rank is crashed inside param_sync; the survivors' failed collectives are its consequence."""
    _, d = replay_json(capsys, demo_traces["crash"])
    [s] = d["stuck"]
    assert (s["rank"], s["how"], s["inside"]) == (CULPRIT, "crashed", "action param_sync of sync")


def test_corruption_names_the_tensors(demo_traces, capsys):
    """Verification failures list the mismatched tensor names per rank."""
    _, d = replay_json(capsys, demo_traces["corrupt"])
    assert d["verification"] and all(v["tensors"] for v in d["verification"])
    assert {v["epoch"] for v in d["verification"]} == {AT_STEP}


def test_report_and_timeline_of_every_kind(demo_traces, capsys, tmp_path):
    """The human report starts with the verdict line, and every trace exports a nested Chrome trace."""
    from test_replay import check_chrome_trace

    for kind, trace_dir in demo_traces.items():
        out = tmp_path / f"{kind}.json"
        code = main(["replay", str(trace_dir), "--perfetto", str(out)])
        first = capsys.readouterr().out.splitlines()[0]
        verdict = "ok" if kind == "ok" else EXPECTED[kind][0]
        assert first.startswith(verdict.upper() + ":") and code == (0 if kind == "ok" else 3)
        doc = check_chrome_trace(out)
        assert {e["pid"] for e in doc["traceEvents"]} == set(range(RANKS))
