"""The figures a snapshot takes of memory no driver accounts for (issue 37): torch's allocator counters.

On CUDA the snapshot reads the caching allocator's allocated and reserved
bytes and the pinned host allocator's bytes (``torch_figures``). These tests
give it a torch whose ``cuda`` answers as torch 2.11 does on the H100 (the
nested stats' layout), since this machine has no GPU; ``benchmarks/gpu_drift.py``
checks the same figures on a real one.
"""

from __future__ import annotations

from types import SimpleNamespace

from miles_fsm.states.drift import torch_figures

MiB = 1 << 20


def _torch(*, initialized=True, device=None, host=None, has_host=True, flat_host=None):
    cuda = SimpleNamespace(is_initialized=lambda: initialized, memory_stats_as_nested_dict=lambda: device or {})
    if has_host:
        cuda.host_memory_stats_as_nested_dict = lambda: host or {}
    if flat_host is not None:
        cuda.host_memory_stats = lambda: flat_host
    return SimpleNamespace(cuda=cuda)


def test_cuda_figures_are_read_from_torchs_nested_stats():
    """Allocated and reserved device bytes, and the pinned host bytes, under ``torch:`` tags."""
    device = {"allocated_bytes": {"all": {"current": 3 * MiB, "peak": 9}}, "reserved_bytes": {"all": {"current": 4 * MiB}}}
    host = {"allocated_bytes": {"current": 256 * MiB}, "active_bytes": {"current": 128 * MiB}}
    dev, pinned = torch_figures(_torch(device=device, host=host))
    assert dev == {"torch:allocated": 3 * MiB, "torch:reserved": 4 * MiB}
    assert pinned == {"torch:pinned": 256 * MiB}  # what the pinned allocator owns, its cache included


def test_a_process_that_never_initialized_cuda_reads_nothing():
    """No CUDA context is made for a figure: a CPU process, or one before CUDA is up, has no torch figures."""
    assert torch_figures(_torch(initialized=False, device={"allocated_bytes": {"all": {"current": 1}}})) == ({}, {})
    assert torch_figures(SimpleNamespace()) == ({}, {})


def test_missing_or_odd_stats_are_left_out():
    """An older torch without host stats, or keys it does not have, give no figure rather than a wrong one."""
    device = {"allocated_bytes": {"all": {"current": 5}}, "reserved_bytes": {"all": {}}}
    assert torch_figures(_torch(device=device, has_host=False)) == ({"torch:allocated": 5}, {})
    flat = {"allocated_bytes.current": 7 * MiB, "active_bytes.current": 1}
    assert torch_figures(_torch(device=device, has_host=False, flat_host=flat))[1] == {"torch:pinned": 7 * MiB}
    assert torch_figures(_torch(device={"allocated_bytes": "x"}, host={"allocated_bytes": {"current": 1.5}})) == ({}, {})
