"""The CPU opt-in for real megatron-core (``miles_fsm.drivers.megatron.cpu``): nothing on import, checks first.

The refusals run in this process: they must raise before anything is
patched. What ``enable()`` does runs in a child process, since it cannot be
undone.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from megatron_cpu import megatron_available
from miles_fsm.drivers.megatron import cpu as megatron_cpu
from miles_fsm.drivers.errors import CudaAvailableError, MissingDependencyError, UnsupportedVersionError

ROOT = Path(__file__).resolve().parent.parent
_SKIP = megatron_available()

_CHILD = """
import logging, sys, torch
from torch.overrides import _get_current_function_mode_stack as modes
import miles_fsm.drivers.megatron.driver, miles_fsm.drivers.megatron.config, miles_fsm.drivers.megatron.gpt
import miles_fsm.drivers.megatron.cpu as mc
from megatron.core.tensor_parallel import random as mrandom
before = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.manual_seed, mrandom._get_cuda_rng_state)
assert all(f.__module__.startswith(("torch.cuda", "megatron")) for f in before), before
assert not modes() and mc.enabled() is None, "importing the megatron drivers changed something"
torch.cuda.is_available = lambda: True  # a CUDA host: only force=True may go on
logging.basicConfig(stream=sys.stdout, format="LOG %(message)s")
first = mc.enable(force=True)
again = mc.enable()
after = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.manual_seed, mrandom._get_cuda_rng_state)
assert all(a is not b for a, b in zip(after, before)), "enable() left a patch out"
assert again is first and mc.enabled() is first and first.forced and first.megatron_core.startswith("0.16.")
assert len(modes()) == 1
assert torch.cuda.current_device() == torch.device("cpu")
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.zeros(2).cuda().device.type == "cpu"
assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
print("OK", len(first.patches))
"""


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_importing_changes_nothing_and_only_enable_patches_and_says_so():
    """Importing the megatron drivers leaves torch and megatron untouched; ``enable()`` applies all
    four patches once (a second call changes nothing and returns the same record), logs that it did,
    and with ``force=True`` goes ahead on a host that reports CUDA."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 4" in proc.stdout
    logs = [line for line in proc.stdout.splitlines() if line.startswith("LOG ")]
    assert len(logs) == 1 and "now runs on CPU in this process" in logs[0] and "process-wide" in logs[0]


def test_an_unchecked_megatron_version_is_refused_before_anything_is_patched(monkeypatch):
    """megatron-core outside 0.16.x: ``UnsupportedVersionError`` naming what was found and what is
    supported, and torch is left as it was."""
    monkeypatch.setattr(megatron_cpu, "_installed_version", lambda: "0.19.2")
    current = torch.cuda.current_device
    with pytest.raises(UnsupportedVersionError) as info:
        megatron_cpu.enable(force=True)
    assert (info.value.found, info.value.supported, info.value.package) == ("0.19.2", "0.16.x", "megatron-core")
    assert "0.19.2" in str(info.value) and "0.16.x" in str(info.value)
    assert torch.cuda.current_device is current and megatron_cpu.enabled() is None


def test_cuda_available_is_refused_unless_forced(monkeypatch):
    """With CUDA available and no ``force``, ``CudaAvailableError`` says how many devices and how to
    go on; nothing is patched."""
    monkeypatch.setattr(megatron_cpu, "_installed_version", lambda: "0.16.1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    current = torch.cuda.current_device
    with pytest.raises(CudaAvailableError) as info:
        megatron_cpu.enable()
    assert info.value.devices == 2 and "force=True" in str(info.value)
    assert torch.cuda.current_device is current and megatron_cpu.enabled() is None


def test_without_megatron_core_the_extra_to_install_is_named(monkeypatch):
    """No megatron-core installed: ``MissingDependencyError`` names the package and the extra."""

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(megatron_cpu.metadata, "version", missing)
    with pytest.raises(MissingDependencyError) as info:
        megatron_cpu.enable()
    assert (info.value.package, info.value.extra) == ("megatron-core", "megatron")


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.16.1", True), ("0.16.0rc2", True), ("0.16", True), ("0.17.0", False), ("0.15.3", False),
     ("1.16.0", False), ("0.1.16", False), ("dev", False)],
)  # fmt: skip
def test_the_checked_range_is_0_16_x(version, ok):
    """Only 0.16 releases count as checked, pre-releases included; nothing else does."""
    assert megatron_cpu.supported(version) is ok
