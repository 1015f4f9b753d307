"""Property: on a live or operator-stopped run, replay's ``culprit`` names no rank the evidence does not single out.

A healthy run read mid-flight (or stopped from outside, which leaves the same traces) has every rank
somewhere between the last guard they all passed and the next one, each silent for less than the guard
waits, none closed, none failed. Nothing singles a rank out there: whatever the verdict, ``culprit.ranks``
is empty, nobody is called stuck or crashed, and the exit code says the traces are not a finished run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from miles_fsm.apps.cli import main
from trace_writer import RankWriter

from miles_fsm.states import CYCLE, DEFINITION, State, Strategy, steps_for


def _cuts() -> list[tuple[int, str | None]]:
    """Where a rank can be, after the last sync all passed and up to waiting at the next sync's guard:
    (index of the transition in the cycle, where it stops inside it: planning, an action, the guard, or None
    for finished)."""
    out: list[tuple[int, str | None]] = []
    state = State.TRAINING
    for i, trig in enumerate(CYCLE):
        t = DEFINITION.transition(state, trig)
        if trig.value == "sync":
            return [*out, (i, "planning"), (i, "guard")]
        out.append((i, "planning"))
        out.extend((i, str(s)) for s in steps_for(t, Strategy.REMATERIALIZE))
        out.append((i, None))
        state = t.dest
    raise AssertionError("the cycle has no sync")  # pragma: no cover


CUTS = _cuts()


#: How a launcher's stop closes each rank's trace (``RankContext.on_stopped``): None leaves it open (a live
#: run, or one killed without a word).
STOPS: dict[str | None, dict[str, Any] | None] = {
    None: None,
    "SIGINT": {"error": "RankStoppedError", "message": "stopped by its launcher",
               "fields": {"reason": "signal", "signal": "SIGINT", "failed": []}},
    "timeout": {"error": "RankStoppedError", "message": "stopped by its launcher",
                "fields": {"reason": "timeout", "signal": None, "failed": []}},
    "launcher died": {"error": "LauncherLostError", "message": "its launcher died",
                      "fields": {"launcher_pid": 4242}},
}


def _write_live(root: Path, cycles: int, cuts: list[int], pauses: list[float], stop: str | None = None) -> None:
    for r, (c, pause) in enumerate(zip(cuts, pauses)):
        w = RankWriter(r, len(cuts))
        w.cycles(cycles)
        upto, inside = CUTS[c]
        for i, trig in enumerate(CYCLE[: upto + 1]):
            if i == upto:
                w.emit("demo_tick", dt=pause)  # ranks fall silent at different moments, within the guard's wait
                w.transition(trig.value, stop=inside)
            else:
                w.transition(trig.value)
        closing = STOPS[stop]
        if closing is not None:
            # The stop comes a little after the rank's last record.
            w.close(dt=0.5, **{**closing, "fields": {"rank": r, **closing["fields"]}})
        w.write(root, close=False)


def _replay(capsys: Any, root: Path) -> tuple[int, dict[str, Any]]:
    code = main(["replay", str(root), "--json"])
    return code, orjson.loads(capsys.readouterr().out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    world=st.integers(2, 5),
    cycles=st.integers(1, 2),
    stop=st.sampled_from(list(STOPS)),
)
def test_a_live_or_stopped_run_names_no_culprit(capsys, data, world, cycles, stop):
    """Each rank cut anywhere between the last common guard and waiting at the next, then left open (live) or
    closed by its launcher's stop: no culprit, nobody stuck or crashed, exit 3 (not a finished run), and a
    stopped run's headline says it was stopped from outside."""
    cuts = data.draw(st.lists(st.integers(0, len(CUTS) - 1), min_size=world, max_size=world), label="cuts")
    pauses = data.draw(st.lists(st.floats(0.0, 4.0), min_size=world, max_size=world), label="pauses")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_live(root, cycles, cuts, pauses, stop)
        code, d = _replay(capsys, root)
    if stop is not None:
        assert "stopped from outside" in d["headline"], (cuts, d["headline"])
    assert code == 3
    culprit = d["culprit"]
    assert culprit is None or culprit["ranks"] == [], (cuts, d["headline"])
    assert d["verdict"] == "incomplete", (cuts, d["headline"])
    assert all(s["how"] not in ("stuck", "crashed") for s in d["stuck"]), (cuts, d["stuck"])
