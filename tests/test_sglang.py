"""The SGLang engine driver against the protocol test server, over real HTTP on loopback.

Nothing here ran against real SGLang (it cannot be installed on these
machines): ``tests/sglang_server.py`` enforces the protocol rules of
``../shared/notes/stack-facts.md``, and these tests pin down that the driver
respects them and turns every violation into the project's own error.
"""

from __future__ import annotations

import sys

import httpx
import pytest
import torch

from miles_fsm.config import LifecycleConfig, VerifyConfig
from miles_fsm.drivers.reference import ReferenceTrainer, TrainerConfig
from miles_fsm.drivers.sglang import (
    DistributedConfig,
    HttpConfig,
    HttpTransport,
    SGLangConfig,
    SGLangEngineDriver,
    buckets,
)
from miles_fsm.drivers.errors import EngineRequestError, EngineSessionError, EngineUpdateError
from miles_fsm.drivers.errors import MissingDependencyError
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError, WeightVersionError
from miles_fsm.states.lifecycle import Lifecycle
from miles_fsm.testing import run_cycles
from miles_fsm.states import Side, State, Strategy
from sglang_server import FakeEngine, serve
from toy import ToyTrainer

pytestmark = pytest.mark.timeout(60)



@pytest.fixture
def server():
    with serve() as s:
        yield s


@pytest.fixture
def two_servers():
    with serve() as a, serve() as b:
        yield a, b


def _lifecycle(trainer, driver) -> Lifecycle:
    return Lifecycle(trainer=trainer, engine=driver, config=LifecycleConfig(verify=VerifyConfig(cycles=None)))


def _cycle(lc: Lifecycle) -> None:
    run_cycles(lc)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


# ------------------------------------------------------------------ full cycles


def test_full_cycles_with_toy_trainer_over_http(server):
    """Three full cycles run over HTTP; each push lands bit-exact in one session and sets the epoch as version."""
    trainer = ToyTrainer(numel=64)
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(bucket_bytes=64))
    lc = _lifecycle(trainer, driver)
    lc.start()
    assert server.protocol.released == {"weights", "kv_cache"}
    for epoch in (1, 2, 3):
        lc.fire("offload")
        lc.fire("pause")
        served = server.protocol.weights
        assert set(served) == {"w", "b"}
        assert _same(served["w"], trainer.master.to(torch.bfloat16))
        assert server.protocol.version == str(epoch)
        assert server.protocol.released == set() and not server.protocol.session_open
        for trigger in ("rematerialize", "sync", "resume"):
            lc.fire(trigger)
        assert server.protocol.released == {"weights", "kv_cache"}
    assert lc.state is State.TRAINING
    calls = server.protocol.calls
    assert calls.count("begin_weight_update") == calls.count("end_weight_update") == 3
    # w (128 B of bf16) and b go in separate 64-byte buckets: at least two requests per push.
    assert calls.count("update_weights_from_tensor") >= 6
    driver.close()


def test_full_cycles_with_reference_trainer_and_two_engines(two_servers):
    """The reference trainer (backup strategy) drives two engines; both serve its exact weights and version."""
    a, b = two_servers
    trainer = ReferenceTrainer(config=TrainerConfig(strategy=Strategy.BACKUP))
    driver = SGLangEngineDriver.http([a.url, b.url], config=SGLangConfig(bucket_bytes=16 << 10))
    lc = _lifecycle(trainer, driver)
    lc.start()
    for epoch in (1, 2):
        lc.fire("offload")
        # The push reads the params before param_buffer is paused; after the
        # pause the trainer's storage is gone, so take the copy now.
        expected = {n: t.clone() for n, t in trainer.named_weights()}
        lc.fire("pause")
        for s in (a, b):
            assert set(s.protocol.weights) == set(expected)
            assert all(_same(s.protocol.weights[n], t) for n, t in expected.items())
            assert s.protocol.version == str(epoch)
        for trigger in ("rematerialize", "sync", "resume"):
            lc.fire(trigger)
    assert driver.weight_version() == "2"
    assert lc.state is State.TRAINING
    driver.close()


def test_distributed_push_over_a_gloo_group(two_servers):
    """update_weights_from_distributed: init group, broadcast per bucket, destroy; the engines hold the tensors."""
    a, b = two_servers
    driver = SGLangEngineDriver.http(
        [a.url, b.url],
        config=SGLangConfig(
            method="distributed", bucket_bytes=256, distributed=DistributedConfig(backend="gloo", timeout_s=20)
        ),
    )
    named = [("x", torch.randn(100)), ("y", torch.arange(6, dtype=torch.bfloat16).view(2, 3))]
    driver.update_weights(named, version="7")
    for s in (a, b):
        assert all(_same(s.protocol.weights[n], t) for n, t in named)
        assert s.protocol.version == "7"
        assert s.protocol.groups == {} and not s.protocol.session_open
        assert s.protocol.calls.count("update_weights_from_distributed") == 2  # 400 B, then 12 B
    driver.close()


def test_offline_engine_transport_runs_cycles():
    """The offline Engine transport runs full cycles; the version comes from the driver (the Engine cannot set it)."""
    engine = FakeEngine()
    trainer = ToyTrainer(numel=32)
    driver = SGLangEngineDriver.offline(engine)
    lc = _lifecycle(trainer, driver)
    lc.start()
    _cycle(lc)
    _cycle(lc)
    assert _same(engine.protocol.weights["w"], trainer.master.to(torch.bfloat16))
    assert driver.weight_version() == "2"
    assert engine.protocol.version == "default"  # what get_model_info says: never set by an Engine push
    assert lc.state is State.TRAINING


# ------------------------------------------------------------------ memory rules


def test_double_release_and_resume_of_active_tag_refused_before_sending(server):
    """Used standalone, the driver refuses a double release and a resume of an active tag; nothing is sent."""
    driver = SGLangEngineDriver.http(server.url)
    driver.release_memory("weights")
    with pytest.raises(MemoryTagError, match="already paused"):
        driver.release_memory("weights")
    with pytest.raises(MemoryTagError, match="not paused"):
        driver.resume_memory("kv_cache")
    assert server.protocol.calls == ["release_memory_occupation"]
    assert server.serving
    with pytest.raises(ConfigError, match="unknown SGLang memory tag"):
        driver.release_memory("kv")
    driver.close()


def test_double_release_reaching_the_server_kills_it_and_fails_the_rank(server):
    """A double release that gets through (another client released first) kills the server.

    The lifecycle gets an EngineRequestError naming the engine and the call,
    not an httpx error; the rank is FAILED in the engine release step, and
    the driver assumes the tag released (the side that cannot kill twice).
    """
    other = SGLangEngineDriver.http(server.url)
    other.release_memory("weights")
    driver = SGLangEngineDriver.http(server.url)
    lc = _lifecycle(ToyTrainer(), driver)
    with pytest.raises(EngineRequestError) as info:
        lc.start()
    err = info.value
    assert not isinstance(err, httpx.HTTPError)
    assert err.engine == server.url and err.status is None and "release_memory_occupation(weights)" in err.op
    assert lc.state is State.FAILED and lc.failure.step == "engine.release_memory(weights,kv_cache)"
    assert lc.paused_tags[Side.ENGINE] == frozenset()
    assert driver.released[server.url] == {"weights"}
    assert not server.serving
    with pytest.raises(EngineRequestError, match="no response"):
        driver.weight_version()
    other.close()
    driver.close()


def test_resume_of_a_tag_the_server_never_released_is_an_engine_error(server):
    """The server answers 400 (SGLang's KeyError); the driver raises EngineRequestError and keeps the tag released."""
    driver = SGLangEngineDriver.http(server.url)
    driver.release_memory("kv_cache")
    server.protocol.resume(["kv_cache"])  # someone else resumed it behind the driver's back
    with pytest.raises(EngineRequestError) as info:
        driver.resume_memory("kv_cache")
    assert info.value.status == 400 and "KeyError" in info.value.message
    assert driver.released[server.url] == {"kv_cache"}
    assert server.serving
    driver.close()


def test_release_needs_an_idle_scheduler(server):
    """A release while requests run is a 400; the ledger is unchanged and a later release succeeds."""
    driver = SGLangEngineDriver.http(server.url)
    server.protocol.running = 2
    with pytest.raises(EngineRequestError, match="idle scheduler") as info:
        driver.release_memory("kv_cache")
    assert info.value.status == 400
    assert driver.released[server.url] == set()
    server.protocol.running = 0
    driver.release_memory("kv_cache")
    assert server.protocol.released == {"kv_cache"}
    driver.close()


def test_weights_resume_is_garbage_until_the_next_push(server):
    """After a weights resume the server's weights are NaN and the driver marks the engine stale until a push."""
    driver = SGLangEngineDriver.http(server.url)
    named = [("w", torch.ones(8))]
    driver.update_weights(named, version="a")
    driver.release_memory("weights")
    with pytest.raises(EngineSessionError, match="'weights' memory is released"):
        driver.update_weights(named, version="b")
    driver.resume_memory("weights")
    assert torch.isnan(server.protocol.weights["w"]).all()
    assert driver.stale == {server.url}
    driver.update_weights(named, version="b")
    assert driver.stale == frozenset() and _same(server.protocol.weights["w"], named[0][1])
    driver.close()


def test_resume_all_uses_sglang_order(server):
    """resume_all resumes cuda_graph, then weights, then kv_cache, one request each."""
    driver = SGLangEngineDriver.http(server.url)
    driver.release_all()
    bodies = []
    original = driver._transports[0].resume
    driver._transports[0].resume = lambda tags: (bodies.append(list(tags)), original(tags))[1]
    driver.resume_all()
    assert bodies == [["cuda_graph"], ["weights"], ["kv_cache"]]
    assert server.protocol.released == set()
    driver.close()


# ------------------------------------------------------------------ sessions


def test_update_outside_a_session_and_session_misuse(server):
    """Protocol level: an update outside a session is a 400; a second begin or a stray end is success=False."""
    t = HttpTransport(server.url)
    with pytest.raises(EngineRequestError, match="inside a weight update session") as info:
        t.update_from_tensor(
            [("w", torch.ones(2))], tp_size=1, load_format=None, flush_cache=False, weight_version=None
        )
    assert info.value.status == 400
    with pytest.raises(EngineSessionError, match="no weight update session"):
        t.end_update()
    t.begin_update()
    with pytest.raises(EngineSessionError, match="already open"):
        t.begin_update()
    t.end_update()
    t.close()


def test_an_engine_failing_mid_update_is_named_with_its_step(two_servers):
    """Engine B fails its second bucket: the error names B and the bucket; both sessions are ended.

    The rank is FAILED in engine.push_weights; recovering to OFFLOADED
    re-releases the engine weights, and the retried pause pushes cleanly.
    """
    a, b = two_servers
    b.protocol.fail_at["update_weights_from_tensor"] = (2, "injected: CUDA error in load_weights")
    trainer = ToyTrainer(numel=64)
    driver = SGLangEngineDriver.http([a.url, b.url], config=SGLangConfig(bucket_bytes=64))
    lc = _lifecycle(trainer, driver)
    lc.start()
    lc.fire("offload")
    with pytest.raises(EngineUpdateError) as info:
        lc.fire("pause")
    err = info.value
    assert isinstance(err, EngineRequestError)
    assert err.engine == b.url and err.op == "update_weights_from_tensor (bucket 2/2)" and err.status == 400
    assert err.closed == (a.url, b.url) and err.left_open == ()
    assert "No weight-update session is left open" in str(err)
    assert not a.protocol.session_open and not b.protocol.session_open
    assert a.protocol.paused_mode is None and b.protocol.paused_mode is None  # generation continued
    assert lc.state is State.FAILED and lc.failure.step == "engine.push_weights"
    assert lc.paused_tags[Side.ENGINE] == {"kv_cache"}
    lc.recover(to=State.OFFLOADED)
    assert driver.released == {a.url: {"weights", "kv_cache"}, b.url: {"weights", "kv_cache"}}
    lc.fire("pause")
    assert a.protocol.version == b.protocol.version == "1"
    for trigger in ("rematerialize", "sync", "resume"):
        lc.fire(trigger)
    assert lc.state is State.TRAINING
    driver.close()


def test_a_session_that_cannot_be_ended_is_reported_and_blocks_the_next_push(two_servers):
    """If ending B's session fails too, the error says STILL OPEN, and the next push refuses until it is closed."""
    a, b = two_servers
    b.protocol.fail_at["update_weights_from_tensor"] = (1, "injected")
    b.protocol.fail_at["end_weight_update"] = (1, "injected: scheduler busy")
    driver = SGLangEngineDriver.http([a.url, b.url])
    named = [("w", torch.ones(4))]
    with pytest.raises(EngineUpdateError, match="STILL OPEN") as info:
        driver.update_weights(named, version="1")
    assert info.value.left_open == (b.url,) and info.value.closed == (a.url,)
    assert b.protocol.session_open and set(driver.open_sessions) == {b.url}
    calls_before = len(a.protocol.calls)
    with pytest.raises(EngineSessionError, match="close_sessions"):
        driver.update_weights(named, version="1")
    assert len(a.protocol.calls) == calls_before  # refused before anything was sent
    assert driver.close_sessions() == [b.url]
    driver.update_weights(named, version="1")
    assert driver.weight_version() == "1"
    driver.close()


# ------------------------------------------------------------------ versions, cache


def test_version_mismatch_is_detected(server):
    """An engine that does not store the pushed version fails the push with WeightVersionError naming both."""
    server.protocol.drop_weight_version = True
    driver = SGLangEngineDriver.http(server.url)
    lc = _lifecycle(ToyTrainer(), driver)
    lc.start()
    lc.fire("offload")
    with pytest.raises(WeightVersionError) as info:
        lc.fire("pause")
    assert info.value.expected == "1" and info.value.actual == "default" and info.value.engine == server.url
    assert "'default'" in str(info.value) and "'1'" in str(info.value)
    assert lc.state is State.FAILED
    driver.close()


def test_engines_that_disagree_on_the_version_are_named(two_servers):
    """weight_version() over two engines raises when one serves another version, naming it."""
    a, b = two_servers
    driver = SGLangEngineDriver.http([a.url, b.url])
    driver.update_weights([("w", torch.ones(2))], version="3")
    httpx.post(f"{b.url}/update_weight_version", json={"new_version": "9", "abort_all_requests": False})
    with pytest.raises(WeightVersionError) as info:
        driver.weight_version()
    assert info.value.engine == b.url and info.value.actual == "9" and info.value.expected == "3"
    driver.close()


def test_flush_cache_while_requests_run_and_pause_around_an_update(server):
    """flush_cache is a 400 while requests run; a push aborts them, flushes, and continues generation."""
    driver = SGLangEngineDriver.http(server.url)
    server.protocol.running = 3
    with pytest.raises(EngineRequestError, match="pending requests") as info:
        driver.flush_cache()
    assert info.value.status == 400
    driver.update_weights([("w", torch.ones(2))], version="1")
    watched = ("pause_generation", "begin_weight_update", "end_weight_update", "flush_cache", "continue_generation")
    order = [c for c in server.protocol.calls if c in watched]
    assert order == [
        "flush_cache",
        "pause_generation",
        "begin_weight_update",
        "end_weight_update",
        "flush_cache",
        "continue_generation",
    ]
    assert server.protocol.running == 0 and server.protocol.paused_mode is None
    driver.close()


def test_retract_without_flush_keeps_the_requests(server):
    """pause_mode='retract' (only without a flush) requeues running requests and continue_generation resumes them."""
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(pause_mode="retract", flush_cache=False))
    server.protocol.running = 2
    driver.update_weights([("w", torch.ones(2))], version="1")
    assert server.protocol.running == 2 and "flush_cache" not in server.protocol.calls
    driver.close()


# ------------------------------------------------------------------ transport


def test_reads_are_retried_and_writes_are_not(server):
    """A 503 on /model_info is retried; a 503 on a release is raised at once (it may have happened)."""
    driver = SGLangEngineDriver.http(server.url, http=HttpConfig(read_retries=2, retry_backoff_s=0.01))
    server.protocol.fail_at["model_info"] = (1, "warming up", 503)
    assert driver.weight_version() == "default"
    assert server.protocol.calls.count("model_info") == 2
    server.protocol.fail_at["release_memory_occupation"] = (1, "overloaded", 503)
    with pytest.raises(EngineRequestError) as info:
        driver.release_memory("kv_cache")
    assert info.value.status == 503 and server.protocol.calls.count("release_memory_occupation") == 1
    driver.close()


def test_unreachable_engine_is_an_engine_error():
    """No server on the port: an EngineRequestError with no status, after the read retries."""
    with serve() as s:
        url = s.url
    driver = SGLangEngineDriver.http(url, http=HttpConfig(read_retries=1, retry_backoff_s=0.01, connect_timeout_s=1))
    with pytest.raises(EngineRequestError, match="no response") as info:
        driver.weight_version()
    assert isinstance(info.value.__cause__, httpx.HTTPError)
    driver.close()


def test_missing_httpx_is_a_clear_error(monkeypatch):
    """Without httpx the HTTP transport says which extra to install."""
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(MissingDependencyError, match=r"miles-fsm\[sglang-http\]"):
        HttpTransport("http://127.0.0.1:1")


def test_config_refuses_combinations_that_would_fail_every_push():
    """in_place pausing with a cache flush, bad method and bucket size are all reported at once."""
    with pytest.raises(ConfigError) as info:
        SGLangConfig(method="nccl", bucket_bytes=0, pause_mode="in_place", flush_cache=True)
    assert len(info.value.violations) == 3


def test_buckets_respect_the_size_limit():
    """Consecutive tensors share a bucket up to the limit; a larger tensor is alone."""
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(100)), ("d", torch.zeros(1))]
    sizes = [[n for n, _ in b] for b in buckets(named, 80)]
    assert sizes == [["a", "b"], ["c"], ["d"]]


def test_tp_payloads_one_per_rank():
    """With tp_size=2 the server gets two payloads and stores the tensors once."""
    with serve(tp_size=2) as s:
        driver = SGLangEngineDriver.http(s.url, config=SGLangConfig(tp_size=2))
        driver.update_weights([("w", torch.arange(4.0))], version="1")
        assert _same(s.protocol.weights["w"], torch.arange(4.0))
        driver.close()
        bad = SGLangEngineDriver.http(s.url)
        with pytest.raises(EngineUpdateError, match="one per TP rank"):
            bad.update_weights([("w", torch.arange(4.0))], version="2")
        bad.close()
