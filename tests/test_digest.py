"""The verification digest: chunked SHA256 (``miles_fsm/digest.py``), and ``miles-fsm bench`` on CPU."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from miles_fsm.digest import CHUNK_BYTES, DIGEST_SCHEME, SCHEMES, digest_tensors, start_digests, tensor_digest
from miles_fsm.errors import MemoryReleasedError


def _by_definition(data: bytes, chunk: int, version: bytes) -> str:
    """The digest exactly as the module docstring defines it."""
    leaves = b"".join(hashlib.sha256(data[a : a + chunk]).digest() for a in range(0, len(data), chunk))
    tag = b"miles-fsm chunked-sha256 " + version + b"\x00"
    return hashlib.sha256(tag + struct.pack("<QQ", chunk, len(data)) + leaves).hexdigest()


@pytest.mark.parametrize(("scheme", "chunk", "version"), [("chunked-sha256/v1", 4 << 20, b"v1"),
                                                          ("chunked-sha256/v2", 64 << 10, b"v2")])  # fmt: skip
def test_digest_follows_the_documented_definition(scheme, chunk, version):
    """A 3-chunk tensor, a 1-chunk one and an empty one hash as SHA256(tag, sizes, chunk digests), under
    both schemes, on one thread and on the pool; v2 (the default) differs from v1 by its chunk and tag."""
    assert DIGEST_SCHEME == "chunked-sha256/v2" and SCHEMES[scheme] == chunk
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (2 * CHUNK_BYTES + 12345,), dtype=torch.uint8, generator=g)
    small = torch.randn(33, 7, generator=g).bfloat16()
    tensors = {"big": big, "small": small, "empty": torch.empty(0)}
    pooled = digest_tensors(tensors, threads=3, scheme=scheme)
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert tensor_digest(t, scheme=scheme) == pooled[name] == _by_definition(data, chunk, version)
    assert digest_tensors(tensors, threads=1, scheme=scheme) == pooled


def test_thread_count_and_layout_do_not_change_digests():
    """digest_tensors on 1 or 4 threads, tensor_digest alone, and a non-contiguous view all agree."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(5)}  # 4 MiB each: 20 chunks in all
    tensors["odd"] = torch.randn(300, 200, generator=g).t()
    tensors["half"] = torch.randn(3, 5, generator=g).half()
    one = digest_tensors(tensors, threads=1)
    many = digest_tensors(tensors, threads=4)
    assert one == many == {n: tensor_digest(t) for n, t in tensors.items()}
    assert list(many) == list(tensors)
    assert many["odd"] == tensor_digest(tensors["odd"].contiguous())


def test_one_flipped_bit_in_the_last_chunk_changes_the_digest():
    """Every chunk feeds the root: a flip in the final, short chunk is seen."""
    t = torch.zeros(CHUNK_BYTES + 100, dtype=torch.uint8)
    before = digest_tensors({"x": t, "y": torch.ones(3)}, threads=2)["x"]
    t[-1] ^= 1
    assert digest_tensors({"x": t, "y": torch.ones(3)}, threads=2)["x"] != before


def test_chunk_digests_are_the_leaves_of_the_definition_and_see_a_flipped_bit():
    """What ``verify`` compares (``PendingDigests.chunks``, no roots hashed) is exactly the chunk digests
    the definition roots, on one thread and on the pool; a flip in any chunk changes them."""
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 256, (CHUNK_BYTES + 300,), dtype=torch.uint8, generator=g)
    chunk = SCHEMES[DIGEST_SCHEME]
    data = t.numpy().tobytes()
    leaves = b"".join(hashlib.sha256(data[a : a + chunk]).digest() for a in range(0, len(data), chunk))
    for threads in (1, 3):
        pending = start_digests({"x": t, "e": torch.empty(0)}, threads=threads)
        assert pending.chunks() == {"x": leaves, "e": b""}
        assert pending.result()["x"] == _by_definition(data, chunk, b"v2")
    t[CHUNK_BYTES // 2] ^= 1
    assert start_digests({"x": t}).chunks()["x"] != leaves


def test_released_storage_is_refused_and_hashing_leaves_storage_resizable():
    """A paused region's released storage is never read; hashing must not pin the storage's size,
    or a later pause (storage resize to 0) would fail."""
    t = torch.randn(1000)
    digest_tensors({"t": t}, threads=2)
    t.untyped_storage().resize_(0)  # would raise if hashing had marked it non-resizable
    with pytest.raises(MemoryReleasedError):
        digest_tensors({"t": t})
    with pytest.raises(MemoryReleasedError):
        tensor_digest(t)


@pytest.mark.slow
def test_bench_cli_writes_one_json_with_limits_transitions_and_ratios(tmp_path, assert_no_leftovers):
    """`miles-fsm bench` on CPU (tiny model, no demo): one JSON with the limits, per-transition
    time and bytes, offload/wake ratios and the verification comparison."""
    from miles_fsm.apps.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--out", str(out), "--cycles", "2", "--verified", "1", "--no-demo", "--strategies",
                 "rematerialize", "--cpu-dim", "32", "--cpu-layers", "1", "--cpu-vocab", "64"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    limits = result["limits"]
    assert limits["gloo"]["allreduce_us"] > 0 and limits["trace_event_us"] > 0 and limits["host_copy_GBps"] > 0
    cycles = result["run"]["strategies"]["rematerialize"]["cycles"]
    assert [c["verified"] for c in cycles] == [True, False]
    for c in cycles:
        assert set(c["transitions"]) == {"offload", "pause", "rematerialize", "sync", "resume"}
        assert c["transitions"]["offload"]["bytes"] > 0 and c["offload"]["host_bytes_crossed"] > 0
        assert c["wake"]["vs_limit"] > 0
    summary = result["summary"]
    assert summary["rematerialize"]["offload"]["vs_limit"] > 0
    assert summary["verification"]["stable"] is True
