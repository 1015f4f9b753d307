"""Per-rank traces: one flushed JSON line per record, survives SIGKILL, leaves the host's logging alone."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import orjson
import pytest
import structlog

from miles_fsm import Lifecycle, LifecycleConfig
from miles_fsm.trace.schema import SCHEMA_VERSION
from miles_fsm.trace.writer import Tracer
from toy import ToyEngine, ToyTrainer

REQUIRED = {"v", "rank", "world", "epoch", "seq", "mono_ns", "wall", "event", "state", "trigger"}


def read(path):
    with open(path, "rb") as f:
        return [orjson.loads(x) for x in f.read().splitlines()]


def test_every_record_carries_the_schema_fields(tmp_path):
    """Each record has version, rank, world, epoch, seq, both clocks, event, state and trigger."""
    with Lifecycle(trainer=ToyTrainer(), engine=ToyEngine(), config=LifecycleConfig(trace_dir=tmp_path)) as lc:
        lc.start()
        lc.offload()
    records = read(tmp_path / "rank-0.jsonl")
    assert all(REQUIRED <= r.keys() for r in records)
    assert {r["v"] for r in records} == {SCHEMA_VERSION}
    events = [r["event"] for r in records]
    assert events[0] == "trace_opened"
    assert events.count("transition_finished") == 2
    finished = [r for r in records if r["event"] == "action_finished"]
    assert all(isinstance(r["duration_s"], float) for r in finished)
    assert any(r["bytes_moved"] for r in finished if r["action"] == "backup(actor)")


def test_existing_trace_is_rotated_not_overwritten(tmp_path):
    """A second run in the same directory keeps the first run's file as rank-0.jsonl.1."""
    for _ in range(2):
        Tracer(tmp_path, rank=0, world=1).close()
    assert (tmp_path / "rank-0.jsonl.1").exists()
    assert read(tmp_path / "rank-0.jsonl")[0]["rotated_to"].endswith("rank-0.jsonl.1")


def test_host_logging_configuration_is_untouched(tmp_path):
    """Tracing neither configures structlog globally nor adds handlers to the root logger."""
    before = structlog.get_config()
    handlers = list(logging.getLogger().handlers)
    t = Tracer(tmp_path, rank=0, world=1)
    t.emit("x", epoch=0, state=None, trigger=None)
    t.close()
    assert structlog.get_config() == before
    assert logging.getLogger().handlers == handlers


@pytest.mark.slow
def test_trace_of_a_sigkilled_rank_parses_up_to_the_kill(tmp_path):
    """A rank killed with SIGKILL inside a transition leaves a trace whose every complete line parses,
    ending inside the transition it was running."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from toy import ToyEngine, ToyTrainer
        from miles_fsm import Lifecycle, LifecycleConfig
        trainer = ToyTrainer()
        def slow_backup(tag, _orig=trainer.backup):
            if tag == "actor":
                print("inside", flush=True)
                time.sleep(60)
            return _orig(tag)
        trainer.backup = slow_backup
        lc = Lifecycle(trainer=trainer, engine=ToyEngine(), config=LifecycleConfig(trace_dir={str(tmp_path)!r}))
        lc.start()
        lc.offload()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"inside"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    records = read(tmp_path / "rank-0.jsonl")
    assert records[-1]["event"] == "action_started"
    assert records[-1]["action"] == "backup(actor)"
    assert records[-1]["trigger"] == "offload"
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_the_hosts_structlog_context_joins_every_record(tmp_path):
    """Keys the host binds with structlog.contextvars.bind_contextvars (a job id, an RL step) appear in every
    record written while they are bound, and not after."""
    import orjson
    import structlog.contextvars

    tracer = Tracer(tmp_path, rank=0, world=1, run="r")
    structlog.contextvars.bind_contextvars(job="ppo-7", rl_step=3)
    try:
        tracer.emit("demo_step", epoch=1, state="TRAINING", trigger=None)
    finally:
        structlog.contextvars.clear_contextvars()
    tracer.emit("demo_step", epoch=1, state="TRAINING", trigger=None)
    tracer.close()
    first, bound, unbound, closed = [orjson.loads(x) for x in (tmp_path / "rank-0.jsonl").read_bytes().splitlines()]
    assert (bound["job"], bound["rl_step"]) == ("ppo-7", 3)
    assert "job" not in unbound and "job" not in first and closed["event"] == "trace_closed"


def test_a_field_named_like_a_constant_field_wins_and_the_line_stays_json(tmp_path):
    """A record that sets ``rank`` or ``world`` itself gets its own value, once, in a line that parses,
    as a merged dict would have it; the records around it keep the tracer's values."""
    tracer = Tracer(tmp_path, rank=2, world=4, run="r")
    tracer.emit("demo_step", epoch=1, state=None, trigger=None, rank=7)
    tracer.emit("demo_step", epoch=1, state=None, trigger=None)
    tracer.close()
    raw = (tmp_path / "rank-2.jsonl").read_bytes().splitlines()
    overridden, plain = orjson.loads(raw[1]), orjson.loads(raw[2])
    assert raw[1].count(b'"rank":') == 1 and overridden["rank"] == 7 and overridden["world"] == 4
    assert (plain["rank"], plain["run"], plain["seq"]) == (2, "r", 2)


def test_emit_after_close_fails_and_writes_nowhere(tmp_path):
    """A record emitted after close() raises instead of landing in whatever file reuses the descriptor."""
    tracer = Tracer(tmp_path, rank=0, world=1, run="r")
    tracer.close()
    other = tmp_path / "other.txt"
    with open(other, "wb", buffering=0), pytest.raises(OSError):
        tracer.emit("late", epoch=0, state=None, trigger=None)
    assert other.read_bytes() == b""


def test_trace_closed_is_the_last_line_while_another_thread_writes(tmp_path):
    """close() from one thread (a launcher-lost callback) while another emits: nothing lands after trace_closed,
    and the writer's next record fails instead (found by the demo's SIGKILL test under load)."""
    import threading

    import orjson

    for attempt in range(20):
        tracer = Tracer(tmp_path / str(attempt), rank=0, world=1, run="r")
        started, failed = threading.Event(), []

        def write() -> None:
            started.set()
            try:
                while True:
                    tracer.emit("action_started", epoch=1, state="TRAINING", trigger="offload", action="x")
            except OSError as exc:
                failed.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        started.wait()
        tracer.close()
        writer.join(timeout=10)
        assert not writer.is_alive() and failed
        records = [orjson.loads(x) for x in tracer.path.read_bytes().splitlines()]
        assert records[-1]["event"] == "trace_closed", records[-1]
        assert [r["seq"] for r in records] == list(range(len(records)))
