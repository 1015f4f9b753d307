"""Per-cycle memory drift (issue 28): the snapshot, the live check, its policies and its config."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from miles_fsm.config import DriftConfig, LifecycleConfig, VerifyConfig
from miles_fsm.drivers.cpu_memory import CpuMemorySaver
from miles_fsm.drivers.reference.engine import EngineConfig, ReferenceEngine
from miles_fsm.drivers.reference.trainer import ReferenceTrainer, TrainerConfig
from miles_fsm.errors import ConfigError
from miles_fsm.memory_drift import DriftTracker
from miles_fsm.replay.report import replay, report_lines
from miles_fsm.states import State, Strategy
from miles_fsm.states.drift import MemoryDriftWarning
from miles_fsm.states.errors import MemoryDriftError
from miles_fsm.states.lifecycle import Lifecycle
from miles_fsm.trace.schema import MEMORY_DRIFT, MEMORY_SNAPSHOT
from test_replay import check_chrome_trace

MiB = 1 << 20


class LeakyTrainer(ReferenceTrainer):
    """Keeps a growing host buffer alive under the ``stash`` tag from cycle ``leak_from`` on."""

    leak_from = 10**9
    leak_bytes = 2 * MiB

    def backup(self, tag):
        report = super().backup(tag)
        if tag == "actor" and self.epoch_seen >= self.leak_from:
            kept = self._host.setdefault("stash", {})
            kept[f"leak{len(kept)}"] = torch.empty(self.leak_bytes, dtype=torch.uint8)
        return report

    epoch_seen = 0


def _lifecycle(strategy, drift, trace_dir=None, trainer_cls=ReferenceTrainer):
    saver = CpuMemorySaver()
    trainer = trainer_cls(config=TrainerConfig(strategy=strategy), saver=saver)
    engine = ReferenceEngine(config=EngineConfig(), saver=saver)
    config = LifecycleConfig(verify=VerifyConfig(cycles=1), drift=drift, trace_dir=trace_dir)
    return Lifecycle(trainer=trainer, engine=engine, config=config), trainer


def _cycles(lc, trainer, n):
    from miles_fsm.states import Trigger

    for _ in range(n):
        trainer.epoch_seen = lc.epoch + 1
        lc.offload()
        lc.pause()
        for trig in lc.definition.path(State.PAUSED, State.TRAINING) or ():
            lc.fire(Trigger(trig))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(Strategy))
def test_no_false_positive_over_50_healthy_cycles(strategy, tmp_path):
    """50 cycles of the reference trainer and engine: snapshots at every state, and no drift under ``raise``."""
    lc, trainer = _lifecycle(strategy, DriftConfig(policy="raise"), tmp_path)
    with lc:
        lc.start()
        _cycles(lc, trainer, 50)
    records = [json.loads(line) for p in tmp_path.glob("rank-*.jsonl") for line in p.read_text().splitlines()]
    snaps = [r for r in records if r["event"] == MEMORY_SNAPSHOT]
    assert len(snaps) >= 50 * 5 and not [r for r in records if r["event"] == MEMORY_DRIFT]
    paused = [r for r in snaps if r["state"] == State.PAUSED.value]
    assert paused[-1]["device"]["param_buffer"] == 0 and paused[-1]["rss"] > 0  # the actor's memory is released
    d = replay(str(tmp_path))
    assert d.leaks == [] and d.exit_code == 0


def test_raise_names_rank_tag_state_and_slope():
    """A buffer kept alive cycle after cycle under a tag raises ``MemoryDriftError`` with its facts."""
    drift = DriftConfig(policy="raise", abs_bytes=3 * MiB, rel=0.0)
    lc, trainer = _lifecycle(Strategy.BACKUP, drift, trainer_cls=LeakyTrainer)
    trainer.leak_from = 3
    lc.start()
    with pytest.raises(MemoryDriftError) as info:
        _cycles(lc, trainer, 10)
    err = info.value
    assert (err.rank, err.tag, err.kind) == (0, "stash", "host")
    assert err.first_cycle == 4 and err.bytes_per_cycle == 2 * MiB and err.slope == pytest.approx(2 * MiB)
    assert err.state in {s.value for s in State} and "MiB per cycle" in str(err)
    assert lc.state is not State.FAILED  # the transition committed: drift fails no transition


def test_warn_warns_and_traces(tmp_path):
    drift = DriftConfig(policy="warn", abs_bytes=3 * MiB, rel=0.0)
    lc, trainer = _lifecycle(Strategy.BACKUP, drift, tmp_path, trainer_cls=LeakyTrainer)
    trainer.leak_from = 3
    with lc, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lc.start()
        _cycles(lc, trainer, 7)
    found = [w.message for w in caught if isinstance(w.message, MemoryDriftWarning)]
    assert found and {(w.rank, w.finding.tag) for w in found} >= {(0, "stash")}
    records = [json.loads(line) for line in next(tmp_path.glob("rank-*.jsonl")).read_text().splitlines()]
    drifts = [r for r in records if r["event"] == MEMORY_DRIFT]
    assert drifts[0]["tag"] == "stash" and drifts[0]["kind"] == "host" and drifts[0]["first_cycle"] == 4
    # Of the state reached, not of the transition: its trigger's records still end with transition_finished.
    assert drifts[0]["trigger"] is None
    at = records.index(drifts[0])
    assert records[at - 1]["event"] == MEMORY_SNAPSHOT and records[at - 2]["event"] == "transition_finished"
    # Replay finds it from the snapshots alone, beside a verdict that stays ok, and exits 3.
    d = replay(str(tmp_path))
    assert d.verdict == "ok" and d.exit_code == 3
    leak = next(k for k in d.leaks if k["tag"] == "stash")
    assert (leak["rank"], leak["kind"], leak["first_cycle"]) == (0, "host", 4)
    assert leak["slope"] == pytest.approx(2 * MiB) and d.to_json()["leaks"][0]["rank"] == 0
    out = tmp_path.parent / f"{tmp_path.name}.perfetto.json"
    replay(str(tmp_path), perfetto=str(out))
    check_chrome_trace(out)
    counters = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("ph") == "C"]
    host = [e["args"]["stash"] for e in counters if e["name"] == "host memory (MiB)" and "stash" in e["args"]]
    assert host and host[-1] > host[0] and {e["name"] for e in counters} >= {"device memory (MiB)", "rss memory (MiB)"}
    text = "\n".join(t for _, t in report_lines(d))
    assert "Leaks (" in text and "rank 0: host memory under 'stash'" in text


def test_tracker_fits_the_slope_and_skips_warmup():
    """Warm-up cycles are not judged; the slope is the repeated median over the cycles since the baseline."""
    tracker = DriftTracker(DriftConfig(warmup_cycles=2, abs_bytes=10, rel=0.0))
    seen = [tracker.add(c, "PAUSED", [("device", "t", 1000 + 7 * c * c)]) for c in range(1, 9)]
    assert seen[:3] == [[], [], []]  # two cycles of warm-up, then the baseline
    first = next(f for f in seen if f)[0]
    assert first.first_cycle == 4 and first.baseline == 1063
    final = tracker.findings()[0]
    xs = list(range(3, 9))
    ys = [1000 + 7 * x * x for x in xs]
    mx, my = sum(xs) / 6, sum(ys) / 6
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert final.slope == pytest.approx(slope) and final.cycles == 6


def test_noise_within_tolerance_is_not_drift_but_sustained_growth_is():
    """A figure that wobbles below ``abs_bytes`` is never drift; one that rises cycle after cycle is, once it rose ``abs_bytes``."""
    tracker = DriftTracker(DriftConfig(warmup_cycles=0, abs_bytes=100, rel=0.5))
    wobble = [0, 40, 10, 60, 30, 90, 0, 50, 99, 20] * 5
    assert not any(tracker.add(c, "TRAINING", [("rss", "process", 1000 + w)]) for c, w in enumerate(wobble, 1))
    tracker = DriftTracker(DriftConfig(warmup_cycles=0, abs_bytes=100, rel=0.5))
    seen = [tracker.add(c, "TRAINING", [("rss", "process", 1000 + 10 * c)]) for c in range(1, 50)]
    named = [c for c, f in enumerate(seen, 1) if f]
    assert named == [11]  # 10 per cycle: 100 grown over the run from cycle 1, however large the figure


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"warmup_cycles": -1}, "warmup_cycles"),
        ({"abs_bytes": -5}, "abs_bytes"),
        ({"abs_bytes": 1.5}, "abs_bytes"),
        ({"rel": -0.1}, "rel"),
        ({"policy": "explode"}, "policy"),
        ({"sustain_cycles": 0}, "sustain_cycles"),
    ],
)
def test_config_refuses_bad_values(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        DriftConfig(**kwargs)


@pytest.mark.slow
def test_demo_leak_is_named_live_and_by_replay(tmp_path, assert_no_leftovers):
    """``leak:1:2`` on two gloo ranks, 6 steps: a buffer in a plain list, untagged, is named by the RSS that grew.

    The demo's defaults are a user's (``DriftConfig()``); the leak is 64 MiB per step, named by the live check
    and by replay on rank 1 alone, its slope within 15%.
    """
    from miles_fsm.apps.demo import run_demo
    from miles_fsm.apps.demo.config import DemoConfig, Injection
    from miles_fsm.apps.demo.faults import LEAK_BYTES

    result = run_demo(DemoConfig(ranks=2, steps=6, trace_dir=tmp_path / "traces",
                                 injections=(Injection(kind="leak", rank=1, step=2),)))  # fmt: skip
    live = [(f["rank"], f["kind"], f["tag"]) for f in result.drift()]
    assert live == [(1, "rss", "process")]  # the figure that really grew; the healthy rank: nothing
    assert result.ok and result.exit_code == 0 and result.drift_unjudged == (None, False)
    assert result.drift()[0]["slope"] == pytest.approx(LEAK_BYTES, rel=0.15)
    d = replay(str(tmp_path / "traces"))
    assert [(k["rank"], k["kind"], k["tag"]) for k in d.leaks] == [(1, "rss", "process")] and d.exit_code == 3
    assert d.leaks[0]["slope"] == pytest.approx(LEAK_BYTES, rel=0.15)


@pytest.mark.slow
def test_demo_too_short_to_judge_a_leak_says_so(tmp_path, assert_no_leftovers, capsys):
    """``leak:1:2`` with 4 steps cannot be judged: the demo says so and exits 1, and replay notes it."""
    from rich.console import Console

    from miles_fsm.apps.demo import run_demo
    from miles_fsm.apps.demo.config import DemoConfig, Injection
    from miles_fsm.apps.demo.report import print_result

    result = run_demo(DemoConfig(ranks=2, steps=4, trace_dir=tmp_path / "traces",
                                 injections=(Injection(kind="leak", rank=1, step=2),)))  # fmt: skip
    assert result.ok and result.exit_code == 1
    print_result(result, Console(width=200))
    out = capsys.readouterr().out
    assert "FAILED: the injected leak was not judged: 4 steps" in out and "--steps 6" in out
    d = replay(str(tmp_path / "traces"))
    assert any("memory drift not judged on rank(s) 0, 1" in n for n in d.notes), d.notes


class UntaggedLeakTrainer(ReferenceTrainer):
    """A user's bug: from cycle ``leak_from`` on, each backup keeps one more written buffer in a plain list."""

    leak_from = 10**9
    leak_bytes = 64 * MiB
    epoch_seen = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: list[torch.Tensor] = []

    def backup(self, tag):
        report = super().backup(tag)
        if tag == "actor" and self.epoch_seen >= self.leak_from:
            self.kept.append(torch.ones(self.leak_bytes, dtype=torch.uint8))  # written: resident, in the RSS
        return report


@pytest.mark.parametrize("strategy", [Strategy.BACKUP])
def test_untagged_leak_in_a_large_process_is_named_by_the_rss(strategy):
    """A 2.5 GiB process (touched) leaking 64 MiB per cycle from cycle 4, untagged: the RSS is named by cycle 6.

    The rule before issue 37 needed the growth past 64 MiB + 5% of the RSS (~210 MiB here): cycle 7 at the
    earliest, and on an 8 GiB process cycle 11. The slope is within 15% of 64 MiB, live and refitted.
    """
    ballast = torch.ones(5 << 29, dtype=torch.uint8)  # 2.5 GiB, written: the process's own resident memory
    lc, trainer = _lifecycle(strategy, DriftConfig(policy="raise"), trainer_cls=UntaggedLeakTrainer)
    trainer.leak_from = 4
    lc.start()
    try:
        with pytest.raises(MemoryDriftError) as info:
            _cycles(lc, trainer, 8)
        err = info.value
        assert (err.kind, err.tag) == ("rss", "process") and err.first_cycle == 4
        assert lc.epoch <= 6, f"named at cycle {lc.epoch}: more than 3 cycles after the leak began"
        assert err.slope == pytest.approx(64 * MiB, rel=0.15)
        assert lc.drift.tracker.findings()[0].slope == pytest.approx(64 * MiB, rel=0.15)
    finally:
        trainer.kept.clear()
        del ballast
