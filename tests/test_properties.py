"""Property tests: random trigger sequences against the table, and the trace read back."""

from __future__ import annotations

import tempfile

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_fsm import Lifecycle, LifecycleConfig, State, Trigger, TransitionNotAllowed, VerifyConfig
from miles_fsm.states import DEFINITION
from toy import ToyEngine, ToyTrainer

ACTIONS = st.lists(
    st.one_of(
        st.sampled_from(list(Trigger)).map(lambda t: ("fire", t)),
        st.just(("fail_next", None)),
        st.sampled_from([State.PAUSED, State.TRAINING]).map(lambda s: ("recover", s)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_random_sequences_follow_the_table_and_the_trace_agrees(actions):
    """Whatever is fired, the state only moves along the table (or to FAILED on a failing step),
    and the trace, read back, gives the same state sequence."""
    with tempfile.TemporaryDirectory() as d:
        trainer = ToyTrainer()
        lc = Lifecycle(
            trainer=trainer, engine=ToyEngine(), config=LifecycleConfig(trace_dir=d, verify=VerifyConfig(cycles=None))
        )
        states = [lc.state]
        for kind, arg in actions:
            before = lc.state
            if kind == "fail_next":
                trainer.fail_on = "backup:actor"
                continue
            if kind == "recover":
                if before is State.FAILED:
                    try:
                        lc.recover(arg)
                    except Exception:  # noqa: BLE001 - a refused recovery must leave FAILED as is
                        assert lc.state is State.FAILED
                    else:
                        assert lc.state is arg
                        states.append(lc.state)
                continue
            allowed = DEFINITION.transition(before, arg)
            try:
                lc.fire(arg)
            except TransitionNotAllowed:
                assert allowed is None or before is State.FAILED
                assert lc.state is before
                continue
            except Exception:  # noqa: BLE001 - any failing step (even a driver's KeyError) lands in FAILED
                assert lc.state is State.FAILED
                trainer.fail_on = None
                states.append(lc.state)
                continue
            assert allowed is not None and lc.state is allowed.dest
            states.append(lc.state)
        lc.close()
        with open(f"{d}/rank-0.jsonl", "rb") as f:
            records = [orjson.loads(x) for x in f.read().splitlines()]
        traced = [State.INITIAL] + [
            State(r["state"])
            for r in records
            if r["event"] in ("transition_finished", "transition_failed", "recovered")
        ]
        assert traced == states
        assert [r["seq"] for r in records] == list(range(len(records)))
