"""The SGLang engine driver against the protocol test server, over real HTTP on loopback.

SGLang cannot be installed on the CPU machines: ``tests/sglang_server.py``
enforces the protocol rules SGLang's sources state, in both protocol
generations (with weight-update sessions, 0.5.21+; without, 0.5.17), and
these tests pin down that the driver respects them and turns every violation
into the project's own error. ``tests/test_sglang_gpu.py`` checks the rules
where misuse kills the engine against real SGLang 0.5.17.
"""

from __future__ import annotations

import sys

import httpx
import pytest
import torch

from miles_fsm.config import LifecycleConfig, VerifyConfig
from miles_fsm.drivers.reference.trainer import ReferenceTrainer, TrainerConfig
from miles_fsm.drivers.sglang.driver import (
    DistributedConfig,
    EngineCapabilities,
    HttpConfig,
    HttpTransport,
    SGLangConfig,
    SGLangEngineDriver,
    buckets,
)
from miles_fsm.drivers.errors import (
    EngineRequestError,
    EngineSessionError,
    EngineUpdateError,
    MissingDependencyError,
    WeightChecksumError,
)
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError, WeightVersionError
from miles_fsm.states.lifecycle import Lifecycle
from miles_fsm.testing import run_cycles
from miles_fsm.states import Side, State, Strategy
from sglang_payloads import tensor_checksum
from sglang_server import FakeEngine, FakeEngineWithoutSessions, serve
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


@pytest.fixture
def old_server():
    """SGLang 0.5.17's protocol: no weight-update sessions."""
    with serve(sessions=False, version="0.5.17") as s:
        yield s


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
        assert server.protocol.paused_mode == "abort"  # no request runs on released memory
        lc.fire("offload")
        lc.fire("pause")
        served = server.protocol.weights
        assert set(served) == {"w", "b"}
        assert _same(served["w"], trainer.master.to(torch.bfloat16))
        assert server.protocol.version == str(epoch)
        assert server.protocol.released == set() and not server.protocol.session_open
        assert server.protocol.paused_mode is None  # every tag back: generation continued
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
    assert server.protocol.calls == ["pause_generation", "release_memory_occupation"]
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


def test_resume_of_a_tag_the_server_never_released_kills_it(server):
    """A resume the server disagrees with kills it (0.5.17: the KeyError is raised in the scheduler).

    The driver sees no answer: EngineRequestError without a status, and it
    keeps the tag counted released, the side that cannot kill twice.
    """
    driver = SGLangEngineDriver.http(server.url)
    driver.release_memory("kv_cache")
    server.protocol.resume(["kv_cache"])  # someone else resumed it behind the driver's back
    with pytest.raises(EngineRequestError) as info:
        driver.resume_memory("kv_cache")
    assert info.value.status is None and "resume_memory_occupation(kv_cache)" in info.value.op
    assert driver.released[server.url] == {"kv_cache"}
    assert not server.serving and "KeyError" in server.protocol.death
    driver.close()


def test_release_with_requests_running_aborts_them_first(server):
    """A release while requests run would kill the scheduler, so the driver pauses with 'abort' first.

    The release then finds an idle scheduler; generation stays paused while
    the tag is released and continues once it is back.
    """
    driver = SGLangEngineDriver.http(server.url)
    server.protocol.running = 2
    driver.release_memory("kv_cache")
    assert server.protocol.released == {"kv_cache"} and server.protocol.running == 0
    assert server.protocol.paused_mode == "abort" and driver.paused == {server.url}
    driver.resume_memory("kv_cache")
    assert server.protocol.paused_mode is None and driver.paused == frozenset()
    assert server.protocol.calls == [
        "pause_generation",
        "release_memory_occupation",
        "resume_memory_occupation",
        "continue_generation",
    ]
    driver.close()


def test_release_with_requests_running_and_generation_left_alone_kills_the_server(server):
    """With pause_mode=None the driver does not pause: a busy release kills the server, reported without status."""
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(pause_mode=None))
    server.protocol.running = 1
    with pytest.raises(EngineRequestError) as info:
        driver.release_memory("kv_cache")
    assert info.value.status is None
    assert not server.serving and "idle" in server.protocol.death
    driver.close()


def test_generation_continues_only_when_every_tag_is_back(server):
    """Resuming one of two released tags keeps generation paused; the last one continues it."""
    driver = SGLangEngineDriver.http(server.url)
    driver.release_memory("weights")
    driver.release_memory("kv_cache")
    driver.resume_memory("weights")
    assert server.protocol.paused_mode == "abort"
    driver.update_weights([("w", torch.ones(4))], version="1")
    assert server.protocol.paused_mode == "abort"  # kv_cache is still released
    driver.resume_memory("kv_cache")
    assert server.protocol.paused_mode is None
    assert server.protocol.calls.count("pause_generation") == 1
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
    assert a.protocol.aborted_sessions == b.protocol.aborted_sessions == 1  # ended with abort=True
    # kv_cache is still released: generation stays paused rather than run on it.
    assert a.protocol.paused_mode == b.protocol.paused_mode == "abort"
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
    with pytest.raises(EngineRequestError, match="Flush cache failed") as info:
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


# ------------------------------------------------------------------ capabilities: 0.5.17 and 0.5.21+


def test_capabilities_are_probed_once_without_side_effects(server, old_server):
    """The probe reads the version and finds the routes by OPTIONS (405 = there, 404 = absent).

    It opens no session and computes no checksum, and a second call asks
    nothing more.
    """
    driver = SGLangEngineDriver.http([server.url, old_server.url])
    caps = driver.capabilities()
    assert caps[server.url] == EngineCapabilities(version="0.5.23", sessions=True, weights_checker=True)
    assert caps[old_server.url] == EngineCapabilities(version="0.5.17", sessions=False, weights_checker=True)
    for s in (server, old_server):
        assert s.protocol.calls == ["server_info"]
        assert not s.protocol.session_open
    driver.capabilities()
    assert server.protocol.calls == old_server.protocol.calls == ["server_info"]
    driver.close()


def test_full_cycles_without_sessions(old_server):
    """Against 0.5.17's protocol (404 on the session routes) the push runs without a session, bit-exact."""
    trainer = ToyTrainer(numel=64)
    driver = SGLangEngineDriver.http(old_server.url, config=SGLangConfig(bucket_bytes=64))
    lc = _lifecycle(trainer, driver)
    lc.start()
    for epoch in (1, 2):
        _cycle(lc)
        assert _same(old_server.protocol.weights["w"], trainer.master.to(torch.bfloat16))
        assert old_server.protocol.version == str(epoch)
    calls = old_server.protocol.calls
    assert "begin_weight_update" not in calls and "end_weight_update" not in calls
    assert calls.count("update_weights_from_tensor") >= 4
    assert lc.state is State.TRAINING
    driver.close()


def test_session_routes_are_404_without_sessions(old_server):
    """Protocol level: 0.5.17 has no /begin_weight_update, and updates work without one."""
    t = HttpTransport(old_server.url)
    with pytest.raises(EngineRequestError) as info:
        t.begin_update()
    assert info.value.status == 404
    t.update_from_tensor([("w", torch.ones(2))], tp_size=1, load_format=None, flush_cache=False, weight_version="3")
    assert t.version() == "3"
    t.close()


def test_one_engine_with_sessions_and_one_without(server, old_server):
    """A trainer group can feed engines of both generations: a session only where the engine has one."""
    driver = SGLangEngineDriver.http([server.url, old_server.url])
    named = [("w", torch.arange(8.0))]
    driver.update_weights(named, version="5")
    assert server.protocol.calls.count("begin_weight_update") == 1
    assert "begin_weight_update" not in old_server.protocol.calls
    for s in (server, old_server):
        assert _same(s.protocol.weights["w"], named[0][1]) and s.protocol.version == "5"
    driver.close()


def test_offline_engine_without_sessions_runs_cycles():
    """0.5.17's offline Engine has no begin/end_weight_update: the driver pushes without them."""
    engine = FakeEngineWithoutSessions()
    trainer = ToyTrainer(numel=32)
    driver = SGLangEngineDriver.offline(engine)
    assert driver.capabilities()["engine0"] == EngineCapabilities(version="0.5.17", sessions=False, weights_checker=False)
    lc = _lifecycle(trainer, driver)
    lc.start()
    _cycle(lc)
    assert _same(engine.protocol.weights["w"], trainer.master.to(torch.bfloat16))
    assert "begin_weight_update" not in engine.protocol.calls
    driver.close()


def test_a_failed_session_is_ended_with_abort(server):
    """SGLang must be told a session failed: the driver ends it with abort=True, then reports the failure."""
    server.protocol.fail_at["update_weights_from_tensor"] = (1, "injected")
    driver = SGLangEngineDriver.http(server.url)
    with pytest.raises(EngineUpdateError) as info:
        driver.update_weights([("w", torch.ones(4))], version="1")
    assert info.value.closed == (server.url,)
    assert server.protocol.aborted_sessions == 1 and not server.protocol.session_open
    driver.close()


def test_set_version_never_aborts_requests(server):
    """SGLang's /update_weight_version aborts running requests by default; the driver says not to."""
    t = HttpTransport(server.url)
    server.protocol.running = 2
    t.set_version("9")
    assert server.protocol.running == 2 and t.version() == "9"
    httpx.post(f"{server.url}/update_weight_version", json={"new_version": "10"})
    assert server.protocol.running == 0  # the default the driver avoids
    t.close()


# ------------------------------------------------------------------ checksums


def _cpu_checksums(named):
    """What the test server reports for these weights, one mapping for its one TP rank."""
    return [{n: tensor_checksum(t) for n, t in named}]


def test_push_is_verified_by_the_engines_checksums(server):
    """With expected checksums, the engine's own checksums are read after the push and must match."""
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(expected_checksums=_cpu_checksums))
    named = [("w", torch.randn(16)), ("b", torch.randn(4).to(torch.bfloat16))]
    driver.update_weights(named, version="1")
    assert server.protocol.calls.count("weights_checker") == 1
    assert driver.checksums[server.url].ranks == tuple(_cpu_checksums(named))
    driver.close()


def test_a_weight_the_engine_did_not_take_fails_the_push(server):
    """An engine that silently skips a pushed name (a loader that ignores it) is caught: the name is reported."""
    server.protocol.ignore_names = {"b"}
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(expected_checksums=_cpu_checksums))
    with pytest.raises(WeightChecksumError) as info:
        driver.update_weights([("w", torch.ones(4)), ("b", torch.ones(2))], version="1")
    assert info.value.engine == server.url and info.value.missing == ("b",) and info.value.mismatched == ()
    assert "push again" in str(info.value)
    driver.close()


def test_a_weight_that_landed_differently_fails_the_push(server):
    """A checksum that differs from the expected one names the weight."""

    def expect_other_w(named):
        sums = _cpu_checksums(named)
        sums[0]["w"] = tensor_checksum(torch.zeros(4))
        return sums

    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(expected_checksums=expect_other_w))
    with pytest.raises(WeightChecksumError) as info:
        driver.update_weights([("w", torch.ones(4)), ("b", torch.ones(2))], version="1")
    assert info.value.mismatched == ("w",) and info.value.missing == ()
    driver.close()


def test_engines_fed_the_same_push_must_agree(two_servers):
    """Without expected checksums, engines fed the same push are compared: the odd one is named."""
    a, b = two_servers
    b.protocol.ignore_names = {"x"}
    driver = SGLangEngineDriver.http([a.url, b.url])
    driver.update_weights([("w", torch.ones(4))], version="1")  # both take w: they agree
    with pytest.raises(WeightChecksumError) as info:
        driver.update_weights([("w", torch.ones(4)), ("x", torch.ones(3))], version="2")
    assert info.value.engine == b.url and info.value.against == f"engine {a.url}" and info.value.missing == ("x",)
    driver.close()


def test_no_checksums_without_a_checker_or_when_turned_off():
    """An engine without /weights_checker (404) is not asked; verify_checksums=False asks none."""
    with serve(weights_checker=False) as s:
        driver = SGLangEngineDriver.http(s.url, config=SGLangConfig(expected_checksums=_cpu_checksums))
        driver.update_weights([("w", torch.ones(4))], version="1")
        assert "weights_checker" not in s.protocol.calls and driver.checksums == {}
        driver.close()
    with serve() as s:
        driver = SGLangEngineDriver.http(s.url, config=SGLangConfig(verify_checksums=False))
        driver.update_weights([("w", torch.ones(4))], version="1")
        assert "weights_checker" not in s.protocol.calls
        driver.close()


# ------------------------------------------------------------------ payload formats


@pytest.fixture
def fake_tensor_bucket(monkeypatch):
    """SGLang's ``sglang.srt.weight_sync.tensor_bucket``, as far as the flattened format needs it."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    class FlattenedTensorBucket:
        def __init__(self, named_tensors):
            flats, self.metadata, at = [], [], 0
            for name, t in named_tensors:
                flat = t.flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + flat.numel(), flat.numel()))
                flats.append(flat)
                at += flat.numel()
            self.flat = torch.cat(flats)

        def get_flattened_tensor(self):
            return self.flat

        def get_metadata(self):
            return self.metadata

    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    module.FlattenedTensorBucket = FlattenedTensorBucket
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)


def test_flattened_bucket_push_is_bit_exact(server, fake_tensor_bucket):
    """load_format='flattened_bucket' sends one flat tensor per bucket; mixed dtypes come back bit-exact."""
    config = SGLangConfig(load_format="flattened_bucket", bucket_bytes=64, expected_checksums=_cpu_checksums)
    driver = SGLangEngineDriver.http(server.url, config=config)
    named = [("a", torch.randn(8)), ("b", torch.randn(3, 5).to(torch.bfloat16)), ("c", torch.arange(40.0))]
    driver.update_weights(named, version="1")
    assert all(_same(server.protocol.weights[n], t) for n, t in named)
    assert server.protocol.calls.count("update_weights_from_tensor") == 2  # a+b (62 B), then c alone
    driver.close()


def test_flattened_bucket_through_the_offline_engine(fake_tensor_bucket):
    """The offline Engine takes a flattened bucket already serialized, one payload per TP rank."""
    engine = FakeEngine()
    driver = SGLangEngineDriver.offline(engine, config=SGLangConfig(load_format="flattened_bucket"))
    named = [("a", torch.randn(8)), ("b", torch.randn(2).to(torch.bfloat16))]
    driver.update_weights(named, version="1")
    assert all(_same(engine.protocol.weights[n], t) for n, t in named)
    driver.close()


def test_flattened_bucket_needs_sglang(server, monkeypatch):
    """Without sglang importable the flattened format says so, before anything is sent."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(load_format="flattened_bucket"))
    with pytest.raises(MissingDependencyError, match="flattened_bucket"):
        driver.update_weights([("a", torch.ones(2))], version="1")
    assert server.protocol.calls == []
    driver.close()


def test_payloads_that_sglang_would_not_unpickle_are_refused(server):
    """The server unpickles through SGLang's allow-list: a payload holding a numpy array is a 400."""
    import base64
    import pickle

    import numpy as np

    payload = base64.b64encode(pickle.dumps([("w", np.ones(2))])).decode()
    server.protocol.session_open = True  # the refusal must come from the unpickler, not the session rule
    response = httpx.post(f"{server.url}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    assert response.status_code == 400 and "Blocked unsafe class loading (numpy" in response.json()["message"]
