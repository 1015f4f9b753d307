"""The device digest's kernel checked against hashlib, and the tensors both digest tests use.

``main`` runs under ``TRITON_INTERPRET=1`` in a fresh process (test_digest_device.py starts it): the
interpreter has to be chosen before Triton is first imported. It prints one word per check passed.
"""

from __future__ import annotations

import hashlib

import torch

#: FIPS 180-2 appendix B (and NIST's example values): "abc", the empty string, the 448-bit message.
NIST = {
    b"abc": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
    b"": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq":
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
}  # fmt: skip


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""


def chunked(data: bytes, chunk: int) -> bytes:
    """The chunk digests of ``data``, joined, by hashlib."""
    return b"".join(hashlib.sha256(data[a : a + chunk]).digest() for a in range(0, len(data), chunk))


def tensors(device: str = "cpu", scale: int = 1) -> dict[str, torch.Tensor]:
    """Every dtype the drivers hold, odd sizes, empty and 0-d tensors, non-contiguous and unaligned views."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(37 * scale, 29, generator=g)
    out = {
        "bf16": base.bfloat16(), "fp16": base.half(), "fp32": base, "fp64": base[:5].double(),
        "int64": torch.randint(-(2**40), 2**40, (13 * scale,), generator=g),
        "int32": torch.randint(-(2**30), 2**30, (7, 3), generator=g, dtype=torch.int32),
        "uint8": torch.randint(0, 256, (1001 * scale,), generator=g, dtype=torch.uint8),
        "int8": torch.randint(-128, 128, (63,), generator=g, dtype=torch.int8),
        "bool": torch.rand(129, generator=g) > 0.5,
        "fp8": base[:3].to(torch.float8_e4m3fn), "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5),
    }  # fmt: skip
    out = {k: v.to(device) for k, v in out.items()}
    # Views made where the tensors live (``.to`` would make them contiguous and aligned).
    out.update(transposed=out["fp32"].t(), strided=out["fp32"][::3, 1::2], unaligned=out["uint8"][5:])
    return out


def check_nist_and_padding() -> None:
    """One launch: the NIST vectors, and every length that moves the padding (55/56/63/64/119/120 bytes...)."""
    from miles_fsm.digest_device import chunk_digests

    lengths = [1, 3, 4, 5, 55, 56, 57, 63, 64, 65, 111, 119, 120, 127, 128]
    msgs = [*NIST, *(bytes((7 * i + n) % 256 for i in range(n)) for n in lengths)]
    ts = [torch.frombuffer(bytearray(m), dtype=torch.uint8) if m else torch.empty(0, dtype=torch.uint8) for m in msgs]
    got = chunk_digests(ts, 1 << 20)
    for m, want in NIST.items():
        if m:
            assert got[msgs.index(m)].hex() == want, m
    print("nist")
    for m, d in zip(msgs, got, strict=True):
        assert d == (hashlib.sha256(m).digest() if m else b""), len(m)
    print("padding")


def check_dtypes_and_flip() -> None:
    """128-byte chunks (so a small tensor has several, and the last one is short): the kernel's chunk
    digests equal hashlib's for every dtype and view; a copy with one bit flipped differs in one chunk."""
    from miles_fsm.digest_device import chunk_digests

    ts = tensors()
    flipped = ts["uint8"].clone()
    flipped[500] ^= 4
    names = [*ts, "flipped"]
    got = chunk_digests([*ts.values(), flipped], 128)
    for name, t, d in zip(names, [*ts.values(), flipped], got, strict=True):
        assert d == chunked(as_bytes(t), 128), name
    print("dtypes")
    plain = got[names.index("uint8")]
    diff = [i for i in range(0, len(plain), 32) if got[-1][i : i + 32] != plain[i : i + 32]]
    assert diff == [500 // 128 * 32], diff
    print("flip")


def main() -> None:
    check_nist_and_padding()
    check_dtypes_and_flip()
