"""The SHA-256 kernel (Triton): one lane per chunk, the chunks of many tensors in one launch.

Imported only when a CUDA tensor is digested (``miles_fsm.digest_device``
imports it lazily), so a CPU-only install never needs Triton. The same
kernel runs under ``TRITON_INTERPRET=1`` on host tensors, which is how the
CPU tests pin it to hashlib.

Each lane hashes one chunk (FIPS 180-4 SHA-256): its full 64-byte blocks in
a loop, then one or two final blocks that hold the chunk's last bytes, the
0x80 byte, zeros and the bit length. A lane reads its block as one row of a
``[LANES, 16]`` tile of 32-bit words (16-byte vector loads), and the tile is
split into 16 per-lane words, byte-swapped to big-endian. The 64 rounds are
unrolled at compile time (``tl.static_range``); the message schedule lives in
16 rolling words, so a lane's state fits in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["IV", "K", "sha256_chunks"]

#: FIPS 180-4, 5.3.3 and 4.2.2.
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
K = (
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
)  # fmt: skip
_K = tl.constexpr(K)
_IV = tl.constexpr(IV)


@triton.jit
def _rotr(x, n: tl.constexpr):
    # LLVM turns this pair of shifts into one funnel shift (SHF) on NVIDIA GPUs.
    return (x >> n) | (x << (32 - n))


@triton.jit
def _bswap(x):
    return (x << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | (x >> 24)


@triton.jit
def _expand(w16, w15, w7, w2):
    s0 = _rotr(w15, 7) ^ _rotr(w15, 18) ^ (w15 >> 3)
    s1 = _rotr(w2, 17) ^ _rotr(w2, 19) ^ (w2 >> 10)
    return w16 + s0 + w7 + s1


@triton.jit
def _round(a, b, c, d, e, f, g, h, w, k: tl.constexpr):
    t1 = h + (_rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)) + (g ^ (e & (f ^ g))) + k + w
    t2 = (_rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)) + ((a & b) | (c & (a | b)))
    return t1 + t2, a, b, c, d + t1, e, f, g


@triton.jit
def _compress(s0, s1, s2, s3, s4, s5, s6, s7, tile, LANES: tl.constexpr):
    """One block into the state: ``tile`` is ``[LANES, 16]`` big-endian words."""
    # Split the rows into 16 per-lane words: (0,8) holds words 0 and 8, (4,8) words 4 and 12, ...
    even, odd = tl.split(tl.reshape(tile, [LANES, 8, 2]))
    e0, e2 = tl.split(tl.reshape(even, [LANES, 4, 2]))
    o1, o3 = tl.split(tl.reshape(odd, [LANES, 4, 2]))
    w0, w8 = tl.split(tl.reshape(tl.split(tl.reshape(e0, [LANES, 2, 2]))[0], [LANES, 2]))
    w4, w12 = tl.split(tl.reshape(tl.split(tl.reshape(e0, [LANES, 2, 2]))[1], [LANES, 2]))
    w2, w10 = tl.split(tl.reshape(tl.split(tl.reshape(e2, [LANES, 2, 2]))[0], [LANES, 2]))
    w6, w14 = tl.split(tl.reshape(tl.split(tl.reshape(e2, [LANES, 2, 2]))[1], [LANES, 2]))
    w1, w9 = tl.split(tl.reshape(tl.split(tl.reshape(o1, [LANES, 2, 2]))[0], [LANES, 2]))
    w5, w13 = tl.split(tl.reshape(tl.split(tl.reshape(o1, [LANES, 2, 2]))[1], [LANES, 2]))
    w3, w11 = tl.split(tl.reshape(tl.split(tl.reshape(o3, [LANES, 2, 2]))[0], [LANES, 2]))
    w7, w15 = tl.split(tl.reshape(tl.split(tl.reshape(o3, [LANES, 2, 2]))[1], [LANES, 2]))
    a, b, c, d, e, f, g, h = s0, s1, s2, s3, s4, s5, s6, s7
    for j in tl.static_range(4):
        if j > 0:
            # W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], slot t % 16, in order.
            w0 = _expand(w0, w1, w9, w14)
            w1 = _expand(w1, w2, w10, w15)
            w2 = _expand(w2, w3, w11, w0)
            w3 = _expand(w3, w4, w12, w1)
            w4 = _expand(w4, w5, w13, w2)
            w5 = _expand(w5, w6, w14, w3)
            w6 = _expand(w6, w7, w15, w4)
            w7 = _expand(w7, w8, w0, w5)
            w8 = _expand(w8, w9, w1, w6)
            w9 = _expand(w9, w10, w2, w7)
            w10 = _expand(w10, w11, w3, w8)
            w11 = _expand(w11, w12, w4, w9)
            w12 = _expand(w12, w13, w5, w10)
            w13 = _expand(w13, w14, w6, w11)
            w14 = _expand(w14, w15, w7, w12)
            w15 = _expand(w15, w0, w8, w13)
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w0, _K[16 * j + 0])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w1, _K[16 * j + 1])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w2, _K[16 * j + 2])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w3, _K[16 * j + 3])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w4, _K[16 * j + 4])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w5, _K[16 * j + 5])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w6, _K[16 * j + 6])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w7, _K[16 * j + 7])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w8, _K[16 * j + 8])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w9, _K[16 * j + 9])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w10, _K[16 * j + 10])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w11, _K[16 * j + 11])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w12, _K[16 * j + 12])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w13, _K[16 * j + 13])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w14, _K[16 * j + 14])
        a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w15, _K[16 * j + 15])
    return s0 + a, s1 + b, s2 + c, s3 + d, s4 + e, s5 + f, s6 + g, s7 + h


# n_chunks varies call to call: specializing on it (divisible by 16 or not) would compile twice.
@triton.jit(do_not_specialize=["n_chunks"])
def sha256_chunks(base, word_off, nbytes, out, n_chunks, LANES: tl.constexpr):
    """SHA-256 of ``n_chunks`` byte ranges into ``out`` (``[n_chunks, 8]`` int32, the state words).

    Chunk ``i`` is ``nbytes[i]`` bytes from ``base`` (int32) plus ``word_off[i]`` words (int64);
    every chunk starts 16-byte aligned, and a lane may read up to 3 bytes past its chunk's end,
    within the last word it touches.
    """
    base = base.to(tl.pointer_type(tl.int32))
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n_chunks
    off = tl.load(word_off + lane, mask=live, other=0)
    nb = tl.load(nbytes + lane, mask=live, other=0)
    nfull = nb // 64
    col = tl.arange(0, 16)
    s0 = tl.full([LANES], _IV[0], tl.uint32)
    s1 = tl.full([LANES], _IV[1], tl.uint32)
    s2 = tl.full([LANES], _IV[2], tl.uint32)
    s3 = tl.full([LANES], _IV[3], tl.uint32)
    s4 = tl.full([LANES], _IV[4], tl.uint32)
    s5 = tl.full([LANES], _IV[5], tl.uint32)
    s6 = tl.full([LANES], _IV[6], tl.uint32)
    s7 = tl.full([LANES], _IV[7], tl.uint32)
    most = tl.max(nfull, axis=0)
    blk = 0
    while blk < most:  # a while loop: the interpreter cannot take a tensor as a range's bound
        on = blk < nfull
        row = tl.multiple_of(off + blk * 16, 4)
        tile = tl.load(base + row[:, None] + col[None, :], mask=on[:, None], other=0)
        tile = _bswap(tile.to(tl.uint32, bitcast=True))
        n0, n1, n2, n3, n4, n5, n6, n7 = _compress(s0, s1, s2, s3, s4, s5, s6, s7, tile, LANES)
        s0, s1, s2, s3 = tl.where(on, n0, s0), tl.where(on, n1, s1), tl.where(on, n2, s2), tl.where(on, n3, s3)
        s4, s5, s6, s7 = tl.where(on, n4, s4), tl.where(on, n5, s5), tl.where(on, n6, s6), tl.where(on, n7, s7)
        blk += 1
    # The final block or two: the last (nb % 64) bytes, 0x80, zeros, then the bit length (big-endian u64).
    last = tl.where(nb % 64 >= 56, 1, 0)
    bits = nb * 8
    for fin in range(0, 2):
        on = live & (fin <= last)
        first = nfull * 64 + fin * 64  # the block's first byte, within the chunk
        here = nb[:, None] - (first[:, None] + col[None, :] * 4)  # bytes of the chunk in each word
        raw = tl.load(base + (off + first // 4)[:, None] + col[None, :], mask=on[:, None] & (here > 0), other=0)
        word = _bswap(raw.to(tl.uint32, bitcast=True))
        keep = tl.minimum(tl.maximum(here, 0), 3).to(tl.uint32) * 8
        tail = (word & ((0xFFFFFFFF >> keep) ^ 0xFFFFFFFF)) | (0x80000000 >> keep)
        word = tl.where(here >= 4, word, tl.where(here >= 0, tail, 0))
        is_last = (fin == last)[:, None]
        word = tl.where(is_last & (col[None, :] == 14), (bits >> 32).to(tl.uint32)[:, None], word)
        word = tl.where(is_last & (col[None, :] == 15), (bits & 0xFFFFFFFF).to(tl.uint32)[:, None], word)
        n0, n1, n2, n3, n4, n5, n6, n7 = _compress(s0, s1, s2, s3, s4, s5, s6, s7, word, LANES)
        s0, s1, s2, s3 = tl.where(on, n0, s0), tl.where(on, n1, s1), tl.where(on, n2, s2), tl.where(on, n3, s3)
        s4, s5, s6, s7 = tl.where(on, n4, s4), tl.where(on, n5, s5), tl.where(on, n6, s6), tl.where(on, n7, s7)
    dst = out + lane * 8
    tl.store(dst + 0, s0.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 1, s1.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 2, s2.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 3, s3.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 4, s4.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 5, s5.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 6, s6.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + 7, s7.to(tl.int32, bitcast=True), mask=live)
