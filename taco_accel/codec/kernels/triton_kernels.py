"""Fused Triton kernels of the TACO codec: compress, decompress, dequant-sum-requant.

The reference's formulas (`reference`) in one pass over the input each, on tiles of up to BG
consecutive groups of one chunk. `..dispatch` runs them for every group size on GPUs and in
Triton's CPU interpreter; on NVIDIA GPUs `gluon_kernels` compresses and decompresses groups of
up to 128 values instead.

Grid: persistent, as many programs as one SM holds at once (read from the compiled kernel's
registers and shared memory, or `Launch.programs_per_sm`), each walking over tiles with
``tl.range(..., num_stages)``, so that the compiler's software pipeline fetches the next tiles
while one is transformed. A tile never crosses a chunk: its addresses are one block start plus
32-bit offsets, with no per-group division by the chunk's group count.

Transform: one dense product with H_SUB, SUB = min(G, 64), per sub-block of SUB values (a tile
[BG, SUB] @ [SUB, SUB] on the tensor cores); larger groups are 2, 4 or 8 sub-blocks combined by
butterflies (adds and subtracts of whole tiles), since ``H_G = H_(G/SUB) (x) H_SUB``. That
gives the Sylvester coefficient order `layout` puts on the wire, and each tile's rows are
groups, so the per-group reductions work on the product's own register layout. A dense H_128
product would double the tensor-core work per value; a Kronecker H_m (x) H_16 form needs a
transpose between its products, through shared memory.

Exactness: the +-1 matrix is exact in bf16 and fp8. bf16 inputs are exact in bf16 and need one
bf16 product; fp32 and fp16 operands go through two (high and low bf16 halves, about 16
mantissa bits) or one tf32 product (`..tuning.DotMode`). Decoding multiplies the payload bytes
as they are (fp8 or int8 products: no conversion pass first). int8 products are exact; Hopper
accumulates fp8 products in fewer bits than fp32, so decoded fp32 values may differ from the
reference by a few 1e-5 relative, far under bf16 or fp16 output rounding. The interpreter gets
fp32 products (its bf16 products are wrong).

Per value the kernels do as little as the format allows: the transform's 1/sqrt(G) is folded
into the per-group multiplier, the GPU's fp8 conversion saturates by itself (no clamp), and
offsets inside a tile are 32-bit.

Under TRITON_INTERPRET=1 the fp8 cast rounds wrongly where the mantissa carries into the
exponent and does not saturate, so the interpreter clamps and rounds to the fp8 grid first with
exact power-of-two arithmetic (EMULATE_ROUND); the GPU uses the hardware conversion (round to
nearest even, saturating).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..config import CodecConfig
from ..hadamard import device_signs
from ..layout import FORMAT_CODES, PAYLOAD_DTYPES, WireLayout, signed_header
from ..tuning import DotMode, Store, Tuning
from . import interpreting, sm_count
from .reference import ADAPTIVE_EPS, ADAPTIVE_MAX, ADAPTIVE_MIN, FP16_MAX as FP16_MAX_VALUE, TINY_AMAX

# the reference's constants, as compile-time values the kernels may read
_EPS = tl.constexpr(ADAPTIVE_EPS)
_A_MIN = tl.constexpr(ADAPTIVE_MIN)
_A_MAX = tl.constexpr(ADAPTIVE_MAX)
_TINY = tl.constexpr(TINY_AMAX)
FP16_MAX = tl.constexpr(FP16_MAX_VALUE)
SUB_MAX = 64  # largest dense Hadamard block (128 costs twice the tensor-core work per value)


# --- device-side helpers -----------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    """a [R, K] @ b [K, K] (+-1 entries, already in the mode's operand type) -> fp32; DOT_MODE is a
    `DotMode` value (0 FP32, 1 TF32, 2 BF16X2, 3 BF16, 4 PAYLOAD)."""
    if DOT_MODE == 0:
        out = tl.dot(a.to(tl.float32), b, input_precision="ieee")
    elif DOT_MODE == 1:
        out = tl.dot(a.to(tl.float32), b, input_precision="tf32")
    elif DOT_MODE == 2:
        a = a.to(tl.float32)
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(hi, b) + tl.dot(lo, b)
    elif DOT_MODE == 3:
        out = tl.dot(a.to(tl.bfloat16), b)
    else:
        out = tl.dot(a, b).to(tl.float32)  # fp8 x fp8 -> fp32, int8 x int8 -> int32 (exact)
    return out


@triton.jit
def _hadamard(N: tl.constexpr, DOT_MODE: tl.constexpr, payload_ty):
    """Sylvester's H_N, H[i, j] = (-1)^popcount(i & j), in the operand type of DOT_MODE. Made
    from the indices, not loaded: every program needs it before its first product, and a load
    would stand between the program's start and its first tile."""
    bits = tl.arange(0, N)[:, None] & tl.arange(0, N)[None, :]
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)  # bit 0: the parity of popcount(i & j) for i, j < 64
    h = (1 - 2 * (bits & 1)).to(tl.float32)
    if DOT_MODE == 2 or DOT_MODE == 3:
        h = h.to(tl.bfloat16)
    elif DOT_MODE == 4:
        h = h.to(payload_ty)
    return h


@triton.jit
def _butterfly2(a, b):
    return a + b, a - b


# H_(2n) (x) H_SUB on 2n consecutive sub-blocks: butterflies between the two H_n (x) H_SUB halves.
@triton.jit
def _merge2(a0, a1, b0, b1, HADAMARD: tl.constexpr):
    if HADAMARD:
        a0, b0 = _butterfly2(a0, b0)
        a1, b1 = _butterfly2(a1, b1)
    return a0, a1, b0, b1


@triton.jit
def _merge4(a0, a1, a2, a3, b0, b1, b2, b3, HADAMARD: tl.constexpr):
    if HADAMARD:
        a0, b0 = _butterfly2(a0, b0)
        a1, b1 = _butterfly2(a1, b1)
        a2, b2 = _butterfly2(a2, b2)
        a3, b3 = _butterfly2(a3, b3)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _round_half_even(v):
    """Round fp32 ``v`` (|v| < 2**31) to an integer value, ties to even, in exact arithmetic."""
    a = tl.abs(v)
    n = a.to(tl.int32)  # truncation
    frac = a - n.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    r = (n + up.to(tl.int32)).to(tl.float32)
    return tl.where(v < 0, -r, r)


@triton.jit
def _round_to_grid(v, FMT: tl.constexpr):
    """Round fp32 ``v`` (already clamped) to the fp8 grid, half to even, exactly."""
    if FMT == 0:
        MANT: tl.constexpr = 3
        EMIN: tl.constexpr = -6
    else:
        MANT: tl.constexpr = 2
        EMIN: tl.constexpr = -14
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, EMIN) - MANT  # spacing of the fp8 grid around v is 2**step_exp
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    step = ((127 + step_exp) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(v * inv_step) * step


@triton.jit
def _chunk_tile(tile, tiles_per_chunk, gpc, BG: tl.constexpr):
    """Where tile ``tile`` lies: its chunk c (int64) and first row r0 in the chunk, and
    which of its BG rows are groups (r0 + row < gpc). Tiles do not cross chunks, so each of a
    tile's offsets is one block start plus 32-bit multiples of G, with no per-group division
    by gpc (an integer division per value costs more than the memory time of a value)."""
    c = tl.cast(tile // tiles_per_chunk, tl.int64)
    r0 = (tile % tiles_per_chunk) * BG
    return c, r0, r0 + tl.arange(0, BG) < gpc


@triton.jit
def _row_offsets(G: tl.constexpr, W: tl.constexpr, BG: tl.constexpr):
    """32-bit offsets [BG, W] of the first W values of BG consecutive groups of G values."""
    return tl.arange(0, BG)[:, None] * G + tl.arange(0, W)[None, :]


@triton.jit
def _tile_values(ptr, c, r0, gpc, numel, G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr):
    """For the tile of rows r0.. of chunk c (`_chunk_tile`) in the unpacked tensor at ``ptr``:
    its first value (``ptr`` moved there), the 32-bit offsets of sub-block 0 of its BG rows,
    [BG, SUB], and how many of its values lie before ``numel`` and in the chunk (mask:
    offs < left)."""
    start = (c * gpc + r0) * G
    offs = _row_offsets(G, SUB, BG)
    left = tl.minimum(tl.maximum(numel - start, 0), tl.minimum(gpc - r0, BG) * G).to(tl.int32)
    return ptr + start, offs, left


@triton.jit
def _payload_offsets(c, r, chunk_bytes, G: tl.constexpr):
    """Byte offset of the first payload value of row ``r`` of chunk ``c`` (the chunked layout of
    `layout`; group g is row g % gpc of chunk g // gpc)."""
    return c * chunk_bytes + tl.cast(r, tl.int64) * G  # int64: a chunk may pass 2 GiB


@triton.jit
def _scale_offsets(c, r0, gpc, chunk_bytes, G: tl.constexpr, BG: tl.constexpr):
    """Indices (in fp32 words) of the first scales of the BG rows r0.. of chunk ``c``."""
    return c * (chunk_bytes // 4) + gpc * (G // 4) + r0 + tl.arange(0, BG)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_stats(y, amax, sumsq, SUMSQ: tl.constexpr):
    """Accumulate per-group max |y| (NaN if any value is NaN) and, if asked, sum y^2 over a tile."""
    amax = _max_nan(amax, tl.reduce(tl.abs(y), 1, _max_nan))
    if SUMSQ:
        sumsq = sumsq + tl.sum(y * y, axis=1)
    return amax, sumsq


@triton.jit
def _scales(amax, sumsq, bad_in, NORM: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr,
            DUAL: tl.constexpr, ADAPTIVE: tl.constexpr):
    """Per-group (a, s, mult, bad) from the statistics of the unnormalised coefficients y.

    The transform's coefficients are y * NORM; the wire carries s (and a), and the payload is
    y * mult = clamp(y * NORM * a / s), the reference's formula with NORM folded into mult.
    """
    amax = amax * NORM
    if DUAL and ADAPTIVE:
        a = tl.div_rn(QMAX, tl.sqrt_rn(sumsq * (NORM * NORM) / G + _EPS))
        a = tl.minimum(tl.maximum(a, _A_MIN), _A_MAX)
        amax = amax * a  # == max |a * y|: scaling by a > 0 commutes with rounding and max
    else:
        a = tl.full(amax.shape, 1.0, tl.float32)
    bad = bad_in | (amax != amax) | (amax == float("inf"))  # NaN or Inf in the group, or overflow
    big = amax >= _TINY
    s = tl.where(bad, float("nan"), tl.where(big, tl.div_rn(amax, QMAX), 0.0))
    inv = tl.where(big & (~bad), tl.div_rn(QMAX, tl.where(big, amax, 1.0)), 0.0)
    a = tl.where(bad, 1.0, a)
    return a, s, inv * a * NORM, bad


@triton.jit
def _store_payload(q_ptr, offs, y, mult, bad, mask, FMT: tl.constexpr, QMAX: tl.constexpr,
                   EMULATE_ROUND: tl.constexpr):
    """Quantise one tile y [BG, W] of coefficients (y * mult per group) and store it at ``offs``."""
    q = tl.where(bad[:, None], 0.0, y * mult[:, None])  # a group with NaN or Inf: zeros, NaN scale
    if FMT == 2:
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        if EMULATE_ROUND:
            q = _round_half_even(q)
        else:
            q = libdevice.rint(q)
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    else:
        if EMULATE_ROUND:  # the GPU's conversion saturates by itself
            q = _round_to_grid(tl.minimum(tl.maximum(q, -QMAX), QMAX), FMT)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_scales(s_ptr, c, r0, g_mask, s, a, gpc, chunk_bytes, G: tl.constexpr, BG: tl.constexpr,
                  DUAL: tl.constexpr):
    s_blk = s_ptr + _scale_offsets(c, r0, gpc, chunk_bytes, G, BG)
    tl.store(s_blk, s, mask=g_mask)
    if DUAL:
        tl.store(s_blk + gpc, a, mask=g_mask)


@triton.jit
def _store_tail(q_ptr, c, r0, gpc, chunk_bytes, TAIL: tl.constexpr, HEADER: tl.constexpr, BG: tl.constexpr):
    """Write the TAIL (4, 8, 12 or 16) last bytes of chunk c from its last tile: the 4-byte header
    (HEADER, `layout.header_word` as a signed int32, little-endian), then zeros."""
    k = tl.arange(0, 16)
    byte = tl.where(k < 4, (tl.full((16,), HEADER, tl.int32) >> (8 * k)) & 0xFF, 0).to(tl.uint8)
    last = (r0 + BG >= gpc).to(tl.int32)  # this tile holds the chunk's last group
    tl.store(q_ptr + (c + 1) * chunk_bytes - TAIL + k, byte.to(q_ptr.dtype.element_ty, bitcast=True),
             mask=k < TAIL * last)


@triton.jit
def _t1(x_blk, offs, left, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    """Input sub-block j of a tile, [BG, SUB], times H_SUB (after the signs), fp32; values at
    ``left`` and after (past the input's end) read as zeros."""
    offs = offs + j * SUB
    x = tl.load(x_blk + offs, mask=offs < left, other=0.0)
    if ZERO_NONFINITE:
        x = tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)
    if HADAMARD:
        if SIGNS:
            x = x.to(tl.float32) * tl.load(sign_ptr + j * SUB + tl.arange(0, SUB)[None, :])
        y = _dot(x, h, DOT_MODE)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _t2(x_blk, offs, left, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a = _t1(x_blk, offs, left, sign_ptr, h, j, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b = _t1(x_blk, offs, left, sign_ptr, h, j + 1, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    if HADAMARD:
        a, b = _butterfly2(a, b)
    return a, b


@triton.jit
def _t4(x_blk, offs, left, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1 = _t2(x_blk, offs, left, sign_ptr, h, j, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b0, b1 = _t2(x_blk, offs, left, sign_ptr, h, j + 2, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    return _merge2(a0, a1, b0, b1, HADAMARD)


@triton.jit
def _t8(x_blk, offs, left, sign_ptr, h, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1, a2, a3 = _t4(x_blk, offs, left, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b0, b1, b2, b3 = _t4(x_blk, offs, left, sign_ptr, h, 4, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    return _merge4(a0, a1, a2, a3, b0, b1, b2, b3, HADAMARD)


@triton.jit
def _compress_tile(
    tile, x_ptr, q_ptr, s_ptr, sign_ptr, h, numel, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, ADAPTIVE: tl.constexpr,
    ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr, EMULATE_ROUND: tl.constexpr, TAIL: tl.constexpr, HEADER: tl.constexpr,
):
    NSUB: tl.constexpr = G // SUB
    c, r0, g_mask = _chunk_tile(tile, tiles_per_chunk, gpc, BG)
    x_blk, offs, left = _tile_values(x_ptr, c, r0, gpc, numel, G, SUB, BG)  # past numel: zeros
    q_blk = q_ptr + _payload_offsets(c, r0, chunk_bytes, G)  # offs serve the payload too
    # y_j: sub-block j of H_G x (H_NSUB (x) H_SUB as dense products plus butterflies), unnormalised
    if NSUB == 1:
        y0 = _t1(x_blk, offs, left, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    elif NSUB == 2:
        y0, y1 = _t2(x_blk, offs, left, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    elif NSUB == 4:
        y0, y1, y2, y3 = _t4(x_blk, offs, left, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    else:
        y0, y1, y2, y3, y4, y5, y6, y7 = _t8(x_blk, offs, left, sign_ptr, h, SUB, HADAMARD, SIGNS,
                                             ZERO_NONFINITE, DOT_MODE)
    STATS: tl.constexpr = DUAL and ADAPTIVE
    amax = tl.zeros((BG,), tl.float32)
    sumsq = tl.zeros((BG,), tl.float32)
    amax, sumsq = _row_stats(y0, amax, sumsq, STATS)
    if NSUB >= 2:
        amax, sumsq = _row_stats(y1, amax, sumsq, STATS)
    if NSUB >= 4:
        amax, sumsq = _row_stats(y2, amax, sumsq, STATS)
        amax, sumsq = _row_stats(y3, amax, sumsq, STATS)
    if NSUB >= 8:
        amax, sumsq = _row_stats(y4, amax, sumsq, STATS)
        amax, sumsq = _row_stats(y5, amax, sumsq, STATS)
        amax, sumsq = _row_stats(y6, amax, sumsq, STATS)
        amax, sumsq = _row_stats(y7, amax, sumsq, STATS)
    NORM: tl.constexpr = G**-0.5 if HADAMARD else 1.0
    a, s, mult, bad = _scales(amax, sumsq, tl.zeros((BG,), tl.int1), NORM, G, QMAX, DUAL, ADAPTIVE)
    m = g_mask[:, None]
    _store_payload(q_blk, offs, y0, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
    if NSUB >= 2:
        _store_payload(q_blk, offs + SUB, y1, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
    if NSUB >= 4:
        _store_payload(q_blk, offs + 2 * SUB, y2, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
        _store_payload(q_blk, offs + 3 * SUB, y3, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
    if NSUB >= 8:
        _store_payload(q_blk, offs + 4 * SUB, y4, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
        _store_payload(q_blk, offs + 5 * SUB, y5, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
        _store_payload(q_blk, offs + 6 * SUB, y6, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
        _store_payload(q_blk, offs + 7 * SUB, y7, mult, bad, m, FMT, QMAX, EMULATE_ROUND)
    _store_scales(s_ptr, c, r0, g_mask, s, a, gpc, chunk_bytes, G, BG, DUAL)
    _store_tail(q_ptr, c, r0, gpc, chunk_bytes, TAIL, HEADER, BG)


@triton.jit
def compress_kernel(
    x_ptr, q_ptr, s_ptr, sign_ptr,
    numel, chunks, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, ADAPTIVE: tl.constexpr,
    ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr, EMULATE_ROUND: tl.constexpr, TAIL: tl.constexpr, HEADER: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Encode x (``numel`` values) into the payload at q_ptr and the scales at s_ptr (views of one
    buffer of ``chunks`` chunks of ``gpc`` groups, `layout`); each program walks over tiles."""
    h = _hadamard(SUB, DOT_MODE, q_ptr.dtype.element_ty)
    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):
        _compress_tile(tile, x_ptr, q_ptr, s_ptr, sign_ptr, h, numel, gpc, chunk_bytes, tiles_per_chunk,
                       G, SUB, BG, FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, DOT_MODE,
                       EMULATE_ROUND, TAIL, HEADER)


@triton.jit
def _d1(q_blk, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    """Payload sub-block j of a tile as fp32 [BG, SUB], times H_SUB (exact operands)."""
    q = tl.load(q_blk + offs + j * SUB, mask=g_mask[:, None])
    if HADAMARD:
        y = _dot(q, h, DOT_MODE)
    else:
        y = q.to(tl.float32)
    return y


@triton.jit
def _d2(q_blk, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    a = _d1(q_blk, offs, g_mask, h, j, SUB, HADAMARD, DOT_MODE)
    b = _d1(q_blk, offs, g_mask, h, j + 1, SUB, HADAMARD, DOT_MODE)
    if HADAMARD:
        a, b = _butterfly2(a, b)
    return a, b


@triton.jit
def _d4(q_blk, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    a0, a1 = _d2(q_blk, offs, g_mask, h, j, SUB, HADAMARD, DOT_MODE)
    b0, b1 = _d2(q_blk, offs, g_mask, h, j + 2, SUB, HADAMARD, DOT_MODE)
    return _merge2(a0, a1, b0, b1, HADAMARD)


@triton.jit
def _d8(q_blk, offs, g_mask, h, SUB: tl.constexpr, HADAMARD: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1, a2, a3 = _d4(q_blk, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
    b0, b1, b2, b3 = _d4(q_blk, offs, g_mask, h, 4, SUB, HADAMARD, DOT_MODE)
    return _merge4(a0, a1, a2, a3, b0, b1, b2, b3, HADAMARD)


@triton.jit
def _join2(a, b):
    """[R, W] and [R, W] -> [R, 2W], a's columns then b's. Done in registers: decompress
    compiles to as many shared-memory stores and loads as with one store per sub-block."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _store_decoded(out_blk, left, x, scale, sign_ptr, j: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                   BG: tl.constexpr, SIGNS: tl.constexpr, STORE: tl.constexpr):
    """Scale and store slab j, [BG, W], of a decoded tile. Sub-blocks go out in pairs (W = 2 SUB,
    whole rows at G = 128), with one layout conversion (product layout -> 16-byte stores, through
    shared memory) per pair instead of one per sub-block."""
    x = x * scale[:, None]
    if SIGNS:
        x = x * tl.load(sign_ptr + j * W + tl.arange(0, W)[None, :])
    offs = _row_offsets(G, W, BG) + j * W
    if out_blk.dtype.element_ty == tl.float16:  # saturate: a decoded value past 65504 is not inf
        x = tl.clamp(x, -FP16_MAX, FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    if STORE == 1:
        tl.store(out_blk + offs, x.to(out_blk.dtype.element_ty), mask=offs < left, cache_modifier=".cs")
    else:
        tl.store(out_blk + offs, x.to(out_blk.dtype.element_ty), mask=offs < left)


@triton.jit
def _store_pair(out_blk, left, a, b, scale, sign_ptr, j: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                BG: tl.constexpr, SIGNS: tl.constexpr, STORE: tl.constexpr):
    """Sub-blocks 2j and 2j + 1 of a decoded tile as one slab [BG, 2 SUB] (`_store_decoded`)."""
    _store_decoded(out_blk, left, _join2(a, b), scale, sign_ptr, j, G, 2 * SUB, BG, SIGNS, STORE)


@triton.jit
def _decompress_tile(
    tile, q_ptr, s_ptr, out_ptr, sign_ptr, h, numel, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, DOT_MODE: tl.constexpr,
    STORE: tl.constexpr,
):
    """Decode tile ``tile``: up to BG groups of one chunk (`_chunk_tile`)."""
    NSUB: tl.constexpr = G // SUB
    c, r0, g_mask = _chunk_tile(tile, tiles_per_chunk, gpc, BG)
    s_blk = s_ptr + _scale_offsets(c, r0, gpc, chunk_bytes, G, BG)
    scale = tl.load(s_blk, mask=g_mask, other=0.0)
    if DUAL:
        scale = scale / tl.load(s_blk + gpc, mask=g_mask, other=1.0)
    if HADAMARD:
        scale = scale * (G**-0.5)
    out_blk, offs, left = _tile_values(out_ptr, c, r0, gpc, numel, G, SUB, BG)
    q_blk = q_ptr + _payload_offsets(c, r0, chunk_bytes, G)  # offs serve the payload too
    # H_G = (H_NSUB (x) I)(I (x) H_SUB): the dense products first, on exact payload values
    if NSUB == 1:
        x0 = _d1(q_blk, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
        _store_decoded(out_blk, left, x0, scale, sign_ptr, 0, G, SUB, BG, SIGNS, STORE)
    elif NSUB == 2:
        x0, x1 = _d2(q_blk, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
        _store_pair(out_blk, left, x0, x1, scale, sign_ptr, 0, G, SUB, BG, SIGNS, STORE)
    elif NSUB == 4:
        x0, x1, x2, x3 = _d4(q_blk, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
        _store_pair(out_blk, left, x0, x1, scale, sign_ptr, 0, G, SUB, BG, SIGNS, STORE)
        _store_pair(out_blk, left, x2, x3, scale, sign_ptr, 1, G, SUB, BG, SIGNS, STORE)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _d8(q_blk, offs, g_mask, h, SUB, HADAMARD, DOT_MODE)
        _store_pair(out_blk, left, x0, x1, scale, sign_ptr, 0, G, SUB, BG, SIGNS, STORE)
        _store_pair(out_blk, left, x2, x3, scale, sign_ptr, 1, G, SUB, BG, SIGNS, STORE)
        _store_pair(out_blk, left, x4, x5, scale, sign_ptr, 2, G, SUB, BG, SIGNS, STORE)
        _store_pair(out_blk, left, x6, x7, scale, sign_ptr, 3, G, SUB, BG, SIGNS, STORE)


@triton.jit
def decompress_kernel(
    q_ptr, s_ptr, out_ptr, sign_ptr,
    numel, chunks, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, DOT_MODE: tl.constexpr,
    NUM_STAGES: tl.constexpr, STORE: tl.constexpr,
):
    """Decode the buffer (payload at q_ptr, scales at s_ptr) into ``numel`` values at out_ptr."""
    h = _hadamard(SUB, DOT_MODE, q_ptr.dtype.element_ty)
    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):
        _decompress_tile(tile, q_ptr, s_ptr, out_ptr, sign_ptr, h, numel, gpc, chunk_bytes, tiles_per_chunk,
                         G, SUB, BG, HADAMARD, SIGNS, DUAL, DOT_MODE, STORE)


@triton.jit
def _sum_tile(
    tile, q_ptr, s_ptr, out_q_ptr, out_s_ptr, stride, gpc, chunk_bytes, tiles_per_chunk,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    DUAL: tl.constexpr, ADAPTIVE: tl.constexpr, EMULATE_ROUND: tl.constexpr, TAIL: tl.constexpr, HEADER: tl.constexpr,
):
    c, r0, g_mask = _chunk_tile(tile, tiles_per_chunk, gpc, BG)
    base = _payload_offsets(c, r0, chunk_bytes, G)
    q_blk = q_ptr + base
    offs = _row_offsets(G, G, BG)
    s_blk = s_ptr + _scale_offsets(c, r0, gpc, chunk_bytes, G, BG)
    z = tl.zeros((BG, G), dtype=tl.float32)
    bad = tl.zeros((BG,), dtype=tl.int1)
    for p in tl.static_range(P):  # unrolled: all P loads in flight at once
        q = tl.load(q_blk + p * stride + offs, mask=g_mask[:, None]).to(tl.float32)
        scale = tl.load(s_blk + p * (stride // 4), mask=g_mask, other=0.0)
        if DUAL:
            scale = scale / tl.load(s_blk + p * (stride // 4) + gpc, mask=g_mask, other=1.0)
        bad = bad | (scale != scale)
        z += q * scale[:, None]
    amax = tl.zeros((BG,), tl.float32)
    sumsq = tl.zeros((BG,), tl.float32)
    amax, sumsq = _row_stats(z, amax, sumsq, DUAL and ADAPTIVE)
    a, s, mult, bad = _scales(amax, sumsq, bad, 1.0, G, QMAX, DUAL, ADAPTIVE)
    _store_payload(out_q_ptr + base, offs, z, mult, bad, g_mask[:, None], FMT, QMAX, EMULATE_ROUND)
    _store_scales(out_s_ptr, c, r0, g_mask, s, a, gpc, chunk_bytes, G, BG, DUAL)
    _store_tail(out_q_ptr, c, r0, gpc, chunk_bytes, TAIL, HEADER, BG)


@triton.jit
def sum_kernel(
    q_ptr, s_ptr, out_q_ptr, out_s_ptr, input_stride,
    chunks, gpc, chunk_bytes, tiles_per_chunk,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    DUAL: tl.constexpr, ADAPTIVE: tl.constexpr, EMULATE_ROUND: tl.constexpr, TAIL: tl.constexpr, HEADER: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Dequantise P buffers of one layout (``input_stride`` bytes apart), sum them in fp32 and
    requantise the sum into the buffer at out_q_ptr / out_s_ptr, in the transformed domain."""
    stride = input_stride.to(tl.int64)  # bytes between inputs, a multiple of 4
    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):
        _sum_tile(tile, q_ptr, s_ptr, out_q_ptr, out_s_ptr, stride, gpc, chunk_bytes, tiles_per_chunk,
                  P, G, BG, FMT, QMAX, DUAL, ADAPTIVE, EMULATE_ROUND, TAIL, HEADER)


# --- host side ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _launch(layout: WireLayout, group_size: int, launch: tuple, transform: bool) -> tuple[int, dict]:
    """Tile count and the launch arguments every kernel shares (cached: launches are on the hot
    path). Tiles hold up to BG groups of one chunk (`_chunk_tile`). Tiles of the transforming
    kernels keep at least 64 groups, the row count of one Hopper warpgroup product; larger
    groups take more warps instead of more registers."""
    block_elems, num_warps, stages = launch
    bg = max(64 if transform else 16, min(block_elems // group_size, 256))
    warps = min(8, num_warps * max(1, bg * group_size // block_elems)) if transform else num_warps
    if interpreting():  # numpy computes masked rows too: tiles no larger than a chunk keep CPU tests fast
        bg = min(bg, max(16, triton.next_power_of_2(layout.groups_per_chunk)))
    per_chunk = triton.cdiv(layout.groups_per_chunk, bg)
    args = dict(chunks=layout.chunks, gpc=layout.groups_per_chunk, chunk_bytes=layout.chunk_bytes,
                tiles_per_chunk=per_chunk, G=group_size, BG=bg, NUM_STAGES=stages, num_warps=warps)
    return per_chunk * layout.chunks, args


def _common(layout: WireLayout, config: CodecConfig, step: str, tuning: Tuning) -> tuple[int, dict]:
    launch = tuning.launch(step)
    return _launch(layout, config.group_size, (tuning.block_elems, launch.num_warps, launch.num_stages),
                   not step.startswith("sum"))


_resident: dict[tuple, tuple[int, int]] = {}  # a cache of compiled kernels' resources


def _resident_config(kernel, args: tuple, kwargs: dict, device: torch.device) -> tuple[int, int]:
    """(programs per SM, pipeline stages) for this kernel specialisation, from the compiled
    kernel's resources: as many programs as one SM holds at once (registers, shared memory,
    threads), so that the persistent grid is all resident; stages lowered until the tiles in
    flight fit in shared memory (fp32 input at G=512 needs 128 KiB per tile)."""
    key = (kernel.fn.__name__, device, tuple(a.dtype for a in args),
           tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper() or k == "num_warps")))
    if key in _resident:
        return _resident[key]
    stages = kwargs["NUM_STAGES"]
    while True:
        try:
            compiled = kernel.warmup(*args, grid=(1,), **{**kwargs, "NUM_STAGES": stages})
            compiled._init_handles()
            break
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages -= 1
    props = torch.cuda.get_device_properties(device)
    warps = kwargs["num_warps"]
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    per_sm = max(1, min(65536 // (regs_per_warp * warps),
                        smem // (compiled.metadata.shared + 1024),  # 1 KiB reserved per block
                        props.max_threads_per_multi_processor // (32 * warps)))
    _resident[key] = (per_sm, stages)
    return per_sm, stages


def _run(kernel, step: str, tiles: int, args: tuple, kwargs: dict, tuning: Tuning) -> None:
    """Launch a persistent kernel: programs step over the tiles (one program per tile in the
    interpreter or with ``programs_per_sm`` = 0)."""
    if interpreting():
        kernel[(max(1, tiles),)](*args, **kwargs)
        return
    device = args[0].device
    per_sm, stages = _resident_config(kernel, args, kwargs, device)
    if tuning.launch(step).programs_per_sm is not None:
        per_sm = tuning.launch(step).programs_per_sm
    programs = tiles if per_sm == 0 else min(tiles, per_sm * sm_count(device))
    if tuning.balance:
        programs = triton.cdiv(tiles, triton.cdiv(tiles, programs))
    kernel[(max(1, programs),)](*args, **{**kwargs, "NUM_STAGES": stages})


def _dot_mode(exact_in_bf16: bool, tuning: Tuning) -> int:
    if interpreting():
        return int(DotMode.FP32)
    mode = tuning.dot_mode
    return int(DotMode.BF16 if exact_in_bf16 and mode == DotMode.BF16X2 else mode)


def _sum_step(inputs: int) -> str:
    """The launch step of a sum of ``inputs`` buffers: the loads in flight per tile differ."""
    return "sum_pair" if inputs <= 2 else "sum" if inputs <= 4 else "sum_many"


def compress_into(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout, config: CodecConfig,
                  tuning: Tuning) -> None:
    """Encode the flat tensor ``x`` into ``buffer``; same contract as the reference."""
    x = x.contiguous()
    signs = device_signs(config, x.device)  # read only with random signs (SIGNS)
    tiles, common = _common(layout, config, "compress", tuning)
    args = (x, buffer.view(PAYLOAD_DTYPES[config.format]), buffer.view(torch.float32), signs)
    _run(compress_kernel, "compress", tiles, args, dict(
        numel=layout.numel, **common, TAIL=layout.tail_bytes, HEADER=signed_header(config), SUB=min(config.group_size, SUB_MAX),
        FMT=FORMAT_CODES[config.format], QMAX=config.qmax, HADAMARD=config.hadamard,
        SIGNS=config.random_signs, DUAL=config.scales == "dual", ADAPTIVE=config.adaptive_scale,
        ZERO_NONFINITE=config.nonfinite == "zero", DOT_MODE=_dot_mode(x.dtype == torch.bfloat16, tuning),
        EMULATE_ROUND=interpreting(),
    ), tuning)


def decompress_into(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
                    tuning: Tuning) -> None:
    """Decode ``buffer`` into the flat contiguous tensor ``out``."""
    signs = device_signs(config, buffer.device)
    tiles, common = _common(layout, config, "decompress", tuning)
    mode = _dot_mode(True, tuning)
    if mode != DotMode.FP32 and tuning.payload_dot:
        mode = int(DotMode.PAYLOAD)
    args = (buffer.view(PAYLOAD_DTYPES[config.format]), buffer.view(torch.float32), out, signs)
    _run(decompress_kernel, "decompress", tiles, args, dict(
        numel=layout.numel, **common, SUB=min(config.group_size, SUB_MAX),
        HADAMARD=config.hadamard, SIGNS=config.random_signs, DUAL=config.scales == "dual", DOT_MODE=mode,
        STORE=int(tuning.stores),
    ), tuning)


def sum_into(stacked: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
             tuning: Tuning) -> None:
    """Dequantise, sum and requantise the P buffers of ``stacked`` [P, total_bytes] into ``out``."""
    step = _sum_step(stacked.shape[0])
    tiles, common = _common(layout, config, step, tuning)
    fmt_dtype = PAYLOAD_DTYPES[config.format]
    args = (stacked.view(fmt_dtype), stacked.view(torch.float32), out.view(fmt_dtype), out.view(torch.float32))
    _run(sum_kernel, step, tiles, args, dict(
        input_stride=stacked.stride(0), **common, TAIL=layout.tail_bytes, HEADER=signed_header(config), P=stacked.shape[0],
        FMT=FORMAT_CODES[config.format], QMAX=config.qmax, DUAL=config.scales == "dual",
        ADAPTIVE=config.adaptive_scale, EMULATE_ROUND=interpreting(),
    ), tuning)
