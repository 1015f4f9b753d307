"""The CPU memory saver: torch_memory_saver's pause/resume-by-tag contract on CPU."""

from __future__ import annotations

import pytest
import torch

from miles_fsm.drivers.cpu_memory import CpuMemorySaver, MemorySaver
from miles_fsm.states.errors import MemoryTagError


def test_pause_releases_storage_and_views_see_the_resumed_memory():
    """Pause frees the region's storage; resume reallocates it in place, so views taken before still work."""
    saver = CpuMemorySaver()
    flat = saver.empty("param_buffer", 16, torch.bfloat16)
    view = flat[4:8]
    assert saver.resident_bytes() == 32
    saver.pause("param_buffer")
    assert flat.untyped_storage().nbytes() == 0
    assert saver.resident_bytes() == 0
    saver.resume("param_buffer")
    view.fill_(3.0)
    assert flat[4:8].eq(3.0).all()
    assert saver.resident_bytes() == 32


def test_resume_without_backup_poisons_every_float_dtype_with_nan():
    """A region created without backup comes back NaN, never with its old bytes."""
    saver = CpuMemorySaver()
    regions = [saver.empty("t", 8, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    for r in regions:
        r.fill_(1.0)
    saver.pause("t")
    saver.resume("t")
    for r in regions:
        assert r.isnan().all(), r.dtype


def test_resume_with_backup_restores_contents_and_drops_the_host_copy():
    """backup=True keeps a host copy while paused (counted in host_bytes) and restores it bit-exact."""
    saver = CpuMemorySaver()
    kept = saver.empty("default", 8, torch.float32, backup=True)
    lost = saver.empty("default", 8, torch.float32)
    kept.copy_(torch.arange(8.0))
    saver.pause("default")
    assert saver.host_bytes() == 32
    saver.resume("default")
    assert torch.equal(kept, torch.arange(8.0))
    assert lost.isnan().all()
    assert saver.host_bytes() == 0


def test_double_pause_and_resume_of_active_tag_are_refused_without_side_effects():
    """Misuse that kills the process under torch_memory_saver raises MemoryTagError here, and changes nothing."""
    saver = CpuMemorySaver()
    t = saver.empty("kv_cache", 4, torch.float32)
    with pytest.raises(MemoryTagError, match="not paused"):
        saver.resume("kv_cache")
    saver.pause("kv_cache")
    with pytest.raises(MemoryTagError, match="already paused"):
        saver.pause("kv_cache")
    assert saver.paused_tags == {"kv_cache"}
    saver.resume("kv_cache")
    assert t.untyped_storage().nbytes() == 16


def test_tags_are_independent_and_peak_tracks_the_high_water_mark():
    """Pausing one tag leaves the others resident; the peak counts the most bytes resident at once."""
    saver = CpuMemorySaver()
    saver.empty("a", 10, torch.float32)
    b = saver.empty("b", 10, torch.float32)
    saver.pause("a")
    assert b.untyped_storage().nbytes() == 40
    saver.reset_peak()
    assert saver.peak_bytes() == 40
    saver.resume("a")
    saver.pause("a")
    assert saver.peak_bytes() == 80
    assert saver.resident_bytes(["b"]) == 40


def test_cpu_saver_satisfies_the_memory_saver_protocol():
    """The seam other savers (torch_memory_saver on CUDA) plug into is the MemorySaver protocol."""
    assert isinstance(CpuMemorySaver(), MemorySaver)
