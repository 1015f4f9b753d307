"""The digest on every path gives one answer: hashlib on the host, the Triton kernel on the GPU
(``miles_fsm.digest_device``), under every scheme; and "auto" verification covers every cycle on the GPU.

On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``) when Triton is installed;
``-m gpu`` compares the compiled kernel with the host over the same CUDA tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from digest_interpreted import tensors as _tensors  # tests/ is on the path (conftest)

from miles_fsm import digest_device
from miles_fsm.config import VerifyConfig
from miles_fsm.digest import CHUNK_BYTES, SCHEMES, digest_tensors, tensor_digest
from miles_fsm.errors import ConfigError

# ----------------------------------------------------------------- config


def test_auto_verifies_every_cycle_on_the_gpu_and_a_number_still_limits_it(monkeypatch):
    """The default ("auto") verifies every cycle where the digest runs on the GPU, the first 2 elsewhere;
    an explicit number limits both; bad values are refused."""
    monkeypatch.setenv("CI", "")
    auto = VerifyConfig()
    assert auto.cycles == "auto"
    assert all(auto.active(e, on_device=True) for e in (1, 2, 3, 1000))
    assert [auto.active(e) for e in (1, 2, 3)] == [True, True, False]
    limited = VerifyConfig(cycles=3)
    assert limited.active(3, on_device=True) and not limited.active(4, on_device=True)
    assert VerifyConfig(cycles=None).active(99)
    for bad in (-1, "all", True, 1.5):
        with pytest.raises(ConfigError):
            VerifyConfig(cycles=bad)


# ------------------------------------------------------------- host path


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_dtype_odd_size_and_view_hashes_its_row_major_bytes(scheme):
    """digest_tensors gives, for each tensor, the definition over its ``.contiguous()`` bytes."""
    tensors = _tensors()
    got = digest_tensors(tensors, threads=2, scheme=scheme)
    for name, t in tensors.items():
        assert got[name] == tensor_digest(t.contiguous().clone(), scheme=scheme), name
    assert got["empty"] == tensor_digest(torch.empty(0, dtype=torch.uint8), scheme=scheme)
    assert len(set(got.values())) == len(got)  # distinct contents, distinct digests


def test_one_flipped_bit_anywhere_changes_the_digest():
    """Under v2 (many chunks per tensor): a flip in the first, a middle, a boundary and the last byte,
    and at random places, each changes the digest; every flip restored gives the digest back."""
    t = torch.zeros(3 * SCHEMES["chunked-sha256/v2"] + 77, dtype=torch.uint8)
    before = digest_tensors({"t": t}, threads=2)["t"]
    chunk = SCHEMES["chunked-sha256/v2"]
    g = torch.Generator().manual_seed(3)
    places = [0, 1, chunk - 1, chunk, 2 * chunk + 5, t.numel() - 1, *torch.randint(0, t.numel(), (6,), generator=g)]
    for i in places:
        for bit in (0, 7):
            t[int(i)] ^= 1 << bit
            assert digest_tensors({"t": t}, threads=2)["t"] != before, (int(i), bit)
            t[int(i)] ^= 1 << bit
    assert digest_tensors({"t": t}, threads=2)["t"] == before


def test_unknown_scheme_is_refused():
    with pytest.raises(ConfigError, match="chunked-sha256/v2"):
        digest_tensors({"t": torch.ones(2)}, scheme="chunked-sha256/v9")


# ------------------------------------------------- the kernel, interpreted


@pytest.mark.slow
def test_kernel_under_the_interpreter_equals_hashlib():
    """The kernel itself on CPU, under Triton's interpreter, in a fresh process (the interpreter must be
    chosen before Triton is first imported): tests/digest_interpreted.py's checks, the NIST vectors and
    every padding case, every dtype and view, and a flipped bit."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-c", "import digest_interpreted as c; c.main()"], env=env,
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["nist", "padding", "dtypes", "flip"]


def test_chunk_size_must_be_whole_blocks():
    with pytest.raises(ConfigError):
        digest_device.chunk_digests([torch.ones(4)], 100)


# ----------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_device_digest_equals_the_host_digest(scheme):
    """On CUDA tensors: the kernel, the staging ring and the host definition agree (odd sizes, views,
    every dtype, many tensors in one launch, a tensor over 2 GiB); a flipped bit on the device is seen."""
    tensors = _tensors("cuda", scale=41)
    tensors["big"] = torch.randint(-128, 127, (2**31 + 4099,), dtype=torch.int8, device="cuda")
    tensors.update({f"many{i}": torch.randn(i + 1, 64, device="cuda").bfloat16() for i in range(300)})
    device = digest_tensors(tensors, scheme=scheme, on_device=True)
    ring = digest_tensors(tensors, scheme=scheme, on_device=False)
    assert device == ring
    for name in ("bf16", "transposed", "strided", "unaligned", "empty", "scalar", "fp8", "many17"):
        assert device[name] == tensor_digest(tensors[name].cpu(), scheme=scheme), name
    tensors["big"][CHUNK_BYTES * 300 + 12345] += 1
    assert digest_tensors({"big": tensors["big"]}, scheme=scheme)["big"] != device["big"]
