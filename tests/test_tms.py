"""The torch_memory_saver driver: misuse refused before it reaches the library.

torch_memory_saver needs a GPU (``libcuda.so.1``); these CPU machines have
none. So the CPU tests below replace the library with a recording fake in
``sys.modules``, ONLY to prove that misuse never reaches it (the real
library would ``exit(1)`` the process, which no test could observe). The
``gpu``-marked tests at the end use the real library and run on a GPU host
(`pytest -m gpu tests/test_tms.py`).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import pytest
import torch

from miles_fsm.drivers import tms as tms_mod
from miles_fsm.drivers.cpu_memory import MemorySaver
from miles_fsm.drivers.tms import TmsConfig, TmsMemorySaver, TmsRegion
from miles_fsm.drivers.errors import ResumeMemoryError
from miles_fsm.drivers.errors import MissingDependencyError
from miles_fsm.errors import ConfigError
from miles_fsm.states.errors import MemoryTagError


class _FakeTms:
    """Records calls; exits like the real library on the misuse it would exit on."""

    def __init__(self) -> None:
        self._impl = None
        self.calls: list[str] = []
        self.paused: set[str] = set()
        self.hook_mode = None
        self.retain_cpu_backup = False

    @contextmanager
    def region(self, tag, enable_cpu_backup=False, cpu_backup_backend=None):
        self.calls.append(f"region:{tag}")
        yield

    def pause(self, tag=None):
        self.calls.append(f"pause:{tag}")
        if tag in self.paused:
            raise SystemExit(1)  # what torch_memory_saver does
        self.paused.add(tag)

    def resume(self, tag=None):
        self.calls.append(f"resume:{tag}")
        if tag not in self.paused:
            raise SystemExit(1)
        self.paused.discard(tag)


@pytest.fixture
def fake_tms(monkeypatch):
    fake = _FakeTms()
    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = fake
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    tms_mod._reset_for_tests()
    yield fake
    tms_mod._reset_for_tests()


def _saver(**kw) -> TmsMemorySaver:
    return TmsMemorySaver(config=TmsConfig(hook_mode="torch", synchronize=False, **kw))


def test_tms_saver_implements_the_memory_saver_seam():
    """TmsMemorySaver plugs into the seam the reference drivers allocate through."""
    assert isinstance(TmsMemorySaver(), MemorySaver)


def test_double_pause_and_resume_of_active_tag_never_reach_the_library(fake_tms):
    """A second pause and a resume of an active tag raise MemoryTagError; the library sees neither."""
    saver = _saver()
    saver.pause("param_buffer")
    with pytest.raises(MemoryTagError, match="already paused"):
        saver.pause("param_buffer")
    with pytest.raises(MemoryTagError, match="not paused"):
        saver.resume("grad_buffer")
    saver.resume("param_buffer")
    with pytest.raises(MemoryTagError, match="not paused"):
        saver.resume("param_buffer")
    assert fake_tms.calls == ["pause:param_buffer", "resume:param_buffer"]
    assert fake_tms.hook_mode == "torch"


def test_allocating_into_a_paused_tag_is_refused(fake_tms):
    """region(tag) refuses a paused tag before entering the library's region."""
    saver = _saver()
    saver.pause("default")
    with pytest.raises(MemoryTagError, match="allocate in"):
        with saver.region("default"):
            pass
    assert "region:default" not in fake_tms.calls


def test_two_savers_in_one_process_share_the_ledger(fake_tms):
    """The library is a process singleton: a second saver cannot pause what the first paused."""
    a, b = _saver(), _saver()
    a.pause("default")
    with pytest.raises(MemoryTagError):
        b.pause("default")
    assert b.paused_tags == {"default"}
    with pytest.raises(ConfigError, match="cannot switch"):
        TmsMemorySaver(config=TmsConfig(hook_mode="preload")).pause("x")


def test_preload_without_ld_preload_is_refused_before_loading(fake_tms, monkeypatch):
    """hook_mode='preload' without the library in LD_PRELOAD is a ConfigError saying how to start the process."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    saver = TmsMemorySaver(config=TmsConfig(hook_mode="preload", synchronize=False))
    with pytest.raises(ConfigError, match="LD_PRELOAD"):
        saver.pause("default")
    assert fake_tms.calls == [] and fake_tms.hook_mode is None


def test_expandable_segments_is_refused(fake_tms, monkeypatch):
    """torch_memory_saver refuses expandable_segments; the driver says so before loading it."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ConfigError, match="expandable_segments"):
        _saver().pause("default")


def test_missing_package_names_the_extra(monkeypatch):
    """Without torch-memory-saver installed the error names the 'tms' extra."""
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)
    tms_mod._reset_for_tests()
    with pytest.raises(MissingDependencyError, match=r"miles-fsm\[tms\]"):
        _saver().pause("default")


def test_resume_without_enough_free_memory_is_refused(fake_tms, monkeypatch):
    """A resume the device cannot hold raises ResumeMemoryError instead of the library's exit(1).

    torch.cuda.mem_get_info is stubbed too: there is no device here.
    """
    saver = _saver(resume_margin_bytes=0)
    tms_mod._LEDGER.regions.append(TmsRegion(tag="default", tensor=torch.zeros(1024), backup=True))
    saver.pause("default")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100, 1 << 30))
    with pytest.raises(ResumeMemoryError, match="4096 bytes"):
        saver.resume("default")
    assert saver.paused_tags == {"default"} and fake_tms.calls == ["pause:default"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 30))
    saver.resume("default")
    assert saver.paused_tags == frozenset()


def test_config_rejects_unknown_hook_mode():
    """Only 'preload' and 'torch' exist."""
    with pytest.raises(ConfigError, match="hook_mode"):
        TmsConfig(hook_mode="cuda")


# ---------------------------------------------------------------- real library


@pytest.fixture(scope="module")
def gpu_saver():
    pytest.importorskip("torch_memory_saver")
    return TmsMemorySaver(config=TmsConfig(hook_mode="torch"))


@pytest.mark.gpu
def test_gpu_pause_frees_memory_and_backup_restores_contents(gpu_saver):
    """Pausing 256 MiB frees it on the device; a backed-up region comes back bit-exact."""
    n = 64 << 20  # fp32 elements: 256 MiB
    x = gpu_saver.empty("test_backup", n, torch.float32, backup=True)
    x.copy_(torch.arange(n, device=x.device, dtype=torch.float32))
    expected = x[:: 1 << 16].clone()
    free0, _ = torch.cuda.mem_get_info()
    gpu_saver.pause("test_backup")
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= n * 4 * 0.9
    gpu_saver.resume("test_backup")
    assert torch.equal(x[:: 1 << 16], expected)


@pytest.mark.gpu
def test_gpu_misuse_is_refused_not_fatal(gpu_saver):
    """With the real library, a double pause and a resume of an active tag raise instead of exiting."""
    gpu_saver.empty("test_misuse", 1 << 20, torch.float32)
    gpu_saver.pause("test_misuse")
    with pytest.raises(MemoryTagError):
        gpu_saver.pause("test_misuse")
    gpu_saver.resume("test_misuse")
    with pytest.raises(MemoryTagError):
        gpu_saver.resume("test_misuse")


@pytest.mark.gpu
def test_gpu_retained_backup_survives_cycles(gpu_saver):
    """With retain_cpu_backup the host copy stays between cycles and contents survive every cycle."""
    x = gpu_saver.empty("test_retain", 1 << 22, torch.bfloat16, backup=True)
    x.normal_()
    expected = x.clone()
    gpu_saver.set_retain_cpu_backup(True)
    try:
        for _ in range(3):
            gpu_saver.pause("test_retain")
            gpu_saver.resume("test_retain")
            assert torch.equal(x, expected)
        assert gpu_saver.host_bytes(["test_retain"]) == x.numel() * 2
    finally:
        gpu_saver.set_retain_cpu_backup(False)


@pytest.mark.gpu
def test_gpu_host_copies_round_trip_into_remapped_memory(gpu_saver):
    """HostCopies' chunked loads land bit-exact in memory that was just mapped again (odd sizes, a
    strided tensor, one larger than a chunk), and another tag can be unmapped without a device sync
    while a save is still in flight."""
    from miles_fsm.drivers.pinned import HostCopies, PinnedConfig

    chunk = 1 << 20
    host = HostCopies(config=PinnedConfig(chunk_bytes=chunk, streams=2))
    big = gpu_saver.empty("test_copies", (5 * chunk + 3) // 2, torch.bfloat16)
    odd = gpu_saver.empty("test_copies", 4099, torch.uint8)
    other = gpu_saver.empty("test_copies_other", 1 << 22, torch.float32)
    strided = torch.randn(64, 48, device="cuda").t()
    big.normal_()
    odd.random_(0, 255)
    live = {"big": big, "odd": odd, "strided": strided}
    want = {n: t.clone() for n, t in live.items()}
    host.save("state", live, wait=False)
    gpu_saver.pause("test_copies_other", synchronize=False)
    host.synchronize()
    gpu_saver.pause("test_copies")
    gpu_saver.resume("test_copies")
    strided.fill_(0)
    host.load("state", live)
    for name, t in live.items():
        assert torch.equal(t, want[name]), name
    gpu_saver.resume("test_copies_other")
    del other


def test_exit_past_shutdown_keeps_the_runs_code_and_its_output(tmp_path):
    """A run that passed exits 0 even though something at interpreter shutdown would exit 1 (as
    torch_memory_saver's torch hook does once region tensors were made); what it printed is not lost."""
    import subprocess

    child = (
        "import atexit, os, sys\n"
        "from miles_fsm.drivers.tms import exit_past_shutdown\n"
        "atexit.register(lambda: os._exit(1))\n"  # stands in for the hook's exit at shutdown
        "sys.stdout.write('wrote the JSON')\n"  # unflushed: a pipe is block-buffered
        "exit_past_shutdown(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "wrote the JSON"), proc.stderr
