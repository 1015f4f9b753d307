"""The engine's side of the memory accounting (issue 28): SGLang measured around each release and resume.

The test server enforces SGLang's protocol but holds no GPU memory, so the
probe here models one: a base, plus each tag's bytes while it is not
released, read from the server's own ledger of released tags. A leaking
engine is one whose KV cache comes back larger after each resume.
"""

from __future__ import annotations

import pytest

from miles_fsm.config import LifecycleConfig
from miles_fsm.states.lifecycle import Lifecycle
from miles_fsm.config import DriftConfig, VerifyConfig
from miles_fsm.drivers.sglang import SGLangConfig, SGLangEngineDriver
from miles_fsm.states.errors import MemoryDriftError
from miles_fsm.testing import run_cycles
from sglang_server import serve
from toy import ToyTrainer

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20
SIZES = {"kv_cache": 400 * MiB, "weights": 200 * MiB, "cuda_graph": 0}


class _Device:
    """Bytes in use on a modelled GPU: what the server's tags hold, the KV cache growing from ``leak_after`` resumes."""

    def __init__(self, released: set[str], *, leak_after: int | None = None) -> None:
        self._released, self._leak_after = released, leak_after
        self.kv_resumes, self._kv_was_released = 0, False

    def __call__(self) -> int:
        kv_released = "kv_cache" in self._released
        if self._kv_was_released and not kv_released:
            self.kv_resumes += 1
        self._kv_was_released = kv_released
        grown = 0 if self._leak_after is None else max(0, self.kv_resumes - self._leak_after) * 8 * MiB
        sizes = {**SIZES, "kv_cache": SIZES["kv_cache"] + grown}
        return (1 << 30) + sum(n for tag, n in sizes.items() if tag not in self._released)


def _run(server, device: _Device, cycles: int, drift: DriftConfig) -> SGLangEngineDriver:
    driver = SGLangEngineDriver.http(server.url, config=SGLangConfig(bucket_bytes=1 << 20, memory_probe=device))
    lc = Lifecycle(trainer=ToyTrainer(), engine=driver,
                   config=LifecycleConfig(verify=VerifyConfig(cycles=1), drift=drift))  # fmt: skip
    try:
        lc.start()
        run_cycles(lc, cycles)
    finally:
        lc.close()
        driver.close()
    return driver


def test_each_release_and_resume_is_measured_and_a_healthy_engine_never_drifts():
    with serve() as server:
        device = _Device(server.protocol.released)
        driver = _run(server, device, 12, DriftConfig(policy="raise", abs_bytes=4 * MiB, rel=0.0))
    log = driver.memory_log
    kv = [r for r in log if r["tag"] == "kv_cache"]
    ops = [r["op"] for r in kv]
    # start() releases the KV cache; each cycle resumes it (the engine's turn) and releases it again.
    assert device.kv_resumes == 12 and ops == ["release"] + ["resume", "release"] * 12
    for row in kv:
        freed = row["in_use_before"] - row["in_use_after"]
        assert freed == (SIZES["kv_cache"] if row["op"] == "release" else -SIZES["kv_cache"])
    assert driver.device_bytes_by_tag()["kv_cache"] == SIZES["kv_cache"]


def test_a_kv_cache_that_comes_back_larger_each_cycle_is_named_as_the_engines():
    with serve() as server:
        device = _Device(server.protocol.released, leak_after=3)
        with pytest.raises(MemoryDriftError) as info:
            _run(server, device, 12, DriftConfig(policy="raise", abs_bytes=4 * MiB, rel=0.0))
    err = info.value
    assert (err.tag, err.kind) == ("engine:kv_cache", "device")
    assert err.bytes_per_cycle == 8 * MiB and err.first_cycle >= 4


def test_a_probe_that_is_not_callable_is_refused():
    from miles_fsm.errors import ConfigError

    with pytest.raises(ConfigError, match="memory_probe must be a callable"):
        SGLangConfig(memory_probe=3)  # type: ignore[arg-type]
