"""Fused Triton kernels of the TACO codec: compress, decompress, dequant-sum-requant.

Each kernel makes one pass over its input; a program owns BG consecutive groups.

The Hadamard transform runs on the tensor cores as one dense product with H_SUB,
SUB = min(G, 64), per sub-block of SUB values: a tile [BG, SUB] @ [SUB, SUB]. Larger groups
are 2, 4 or 8 sub-blocks combined by butterflies (adds and subtracts of whole tiles), since
``H_G = H_(G/SUB) (x) H_SUB``. The result is the Sylvester coefficient order that `layout`
puts on the wire, and each tile's rows are groups, so the per-group reductions work on the
product's own layout. Measured on an H200 (benchmarks/RESULTS.md): a Kronecker
H_m (x) H_16 form with a transpose between two 16-wide products spent its time moving tiles
through shared memory (35-48% of copy bandwidth), and one dense H_128 product is bound by
the tensor cores (54% at G=128, against 70% for H_64).

The +-1 matrix is exact in bf16. bf16 inputs and fp8 / int8 payloads are exact in bf16
too, so they need one bf16 product; fp32 and fp16 operands go through two (high and low
bf16 halves, about 16 mantissa bits) or one tf32 product (DOT_MODE). The interpreter on the
CPU gets fp32 products.

Under TRITON_INTERPRET=1 the fp8 cast rounds wrongly where the mantissa carries into the
exponent, so the interpreter rounds to the fp8 grid first with exact power-of-two arithmetic
(EMULATE_ROUND); the GPU uses the hardware conversion (round to nearest even, saturating).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .config import TacoConfig
from .hadamard import hadamard_matrix, sign_vector
from .layout import PAYLOAD_DTYPES, WireLayout
from .reference import ADAPTIVE_EPS, ADAPTIVE_MAX, ADAPTIVE_MIN, TINY_AMAX

FMT_CODE = {"e4m3": 0, "e5m2": 1, "int8": 2}
# DOT_MODE: 0 = fp32 (interpreter), 1 = tf32, 2 = two bf16 products (hi + lo), 3 = one bf16
# product (operand already exact in bf16).
DOT_FP32, DOT_TF32, DOT_BF16X2, DOT_BF16 = 0, 1, 2, 3
# the reference's constants, as compile-time values the kernels may read
_EPS = tl.constexpr(ADAPTIVE_EPS)
_A_MIN = tl.constexpr(ADAPTIVE_MIN)
_A_MAX = tl.constexpr(ADAPTIVE_MAX)
_TINY = tl.constexpr(TINY_AMAX)
SUB_MAX = 64  # largest dense Hadamard block (128 costs twice the tensor-core work per value)

# Launch settings (benchmarks/RESULTS.md has the sweep); the benchmark overrides them.
TUNING = {"block_elems": 8192, "num_warps": 4, "dot_mode": DOT_BF16X2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- device-side helpers -----------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    """a [R, K] fp32 @ b [K, K] (+-1 entries) -> fp32, in the requested precision."""
    if DOT_MODE == 0:
        out = tl.dot(a, b, input_precision="ieee")
    elif DOT_MODE == 1:
        out = tl.dot(a, b, input_precision="tf32")
    elif DOT_MODE == 2:
        bh = b.to(tl.bfloat16)
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(hi, bh) + tl.dot(lo, bh)
    else:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return out


@triton.jit
def _load_square(ptr, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    return tl.load(ptr + rows * N + cols)


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
def _group_ids(BG: tl.constexpr, num_groups):
    g = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    return g, g < num_groups


@triton.jit
def _payload_offsets(g, gpc, chunk_bytes, G: tl.constexpr):
    """Byte offset of each group's first payload value (the chunked layout of `layout`)."""
    return (g // gpc) * chunk_bytes + (g % gpc) * G


@triton.jit
def _scale_offsets(g, gpc, chunk_bytes, G: tl.constexpr):
    """Index (in fp32 words) of each group's first scale."""
    return (g // gpc) * (chunk_bytes // 4) + (gpc * G) // 4 + (g % gpc)


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
def _scales(amax, sumsq, bad_in, G: tl.constexpr, QMAX: tl.constexpr,
            DUAL: tl.constexpr, ADAPTIVE: tl.constexpr):
    """Per-group (a, s, inv, bad) from the row statistics; payload = clamp(y * a * inv)."""
    if DUAL and ADAPTIVE:
        a = tl.div_rn(QMAX, tl.sqrt_rn(sumsq / G + _EPS))
        a = tl.minimum(tl.maximum(a, _A_MIN), _A_MAX)
        amax = amax * a  # == max |a * y|: scaling by a > 0 commutes with rounding and max
    else:
        a = tl.full(amax.shape, 1.0, tl.float32)
    bad = bad_in | (amax != amax) | (amax == float("inf"))  # NaN or Inf in the group, or overflow
    big = amax >= _TINY
    s = tl.where(bad, float("nan"), tl.where(big, tl.div_rn(amax, QMAX), 0.0))
    inv = tl.where(big & (~bad), tl.div_rn(QMAX, tl.where(big, amax, 1.0)), 0.0)
    a = tl.where(bad, 1.0, a)
    return a, s, inv, bad


@triton.jit
def _store_payload(q_ptr, offs, y, a, inv, bad, mask, FMT: tl.constexpr, QMAX: tl.constexpr,
                   DUAL: tl.constexpr, EMULATE_ROUND: tl.constexpr):
    """Quantise one tile y [BG, W] of transformed values and store it at ``offs``."""
    if DUAL:
        y = y * a[:, None]
    q = tl.minimum(tl.maximum(y * inv[:, None], -QMAX), QMAX)
    q = tl.where(bad[:, None], 0.0, q)
    if FMT == 2:
        tl.store(q_ptr + offs, _round_half_even(q).to(tl.int8), mask=mask)
    else:
        if EMULATE_ROUND:
            q = _round_to_grid(q, FMT)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_scales(s_ptr, g, g_mask, s, a, gpc, chunk_bytes, G: tl.constexpr, DUAL: tl.constexpr):
    so = _scale_offsets(g, gpc, chunk_bytes, G)
    tl.store(s_ptr + so, s, mask=g_mask)
    if DUAL:
        tl.store(s_ptr + so + gpc, a, mask=g_mask)


@triton.jit
def _t1(x_ptr, base, numel, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    """Input sub-block j of BG groups, [BG, SUB] fp32, times H_SUB (after the signs)."""
    cols = tl.arange(0, SUB)[None, :]
    idx = base + j * SUB + cols
    x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
    if ZERO_NONFINITE:
        x = tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)
    if HADAMARD:
        if SIGNS:
            x = x * tl.load(sign_ptr + j * SUB + cols)
        x = _dot(x, h, DOT_MODE)
    return x


@triton.jit
def _t2(x_ptr, base, numel, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a = _t1(x_ptr, base, numel, sign_ptr, h, j, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b = _t1(x_ptr, base, numel, sign_ptr, h, j + 1, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    if HADAMARD:
        a, b = _butterfly2(a, b)
    return a, b


@triton.jit
def _t4(x_ptr, base, numel, sign_ptr, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1 = _t2(x_ptr, base, numel, sign_ptr, h, j, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b0, b1 = _t2(x_ptr, base, numel, sign_ptr, h, j + 2, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    return _merge2(a0, a1, b0, b1, HADAMARD)


@triton.jit
def _t8(x_ptr, base, numel, sign_ptr, h, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        SIGNS: tl.constexpr, ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1, a2, a3 = _t4(x_ptr, base, numel, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    b0, b1, b2, b3 = _t4(x_ptr, base, numel, sign_ptr, h, 4, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    return _merge4(a0, a1, a2, a3, b0, b1, b2, b3, HADAMARD)


@triton.jit
def _store_padding(q_ptr, g, g_mask, gpc, chunk_bytes, used_bytes):
    """Zero the (at most 12) padding bytes of each chunk, from the chunk's last group."""
    last = g_mask & ((g % gpc) == gpc - 1)
    start = (g // gpc) * chunk_bytes + used_bytes
    for k in tl.static_range(12):
        zero = tl.zeros(g.shape, tl.float32).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + start + k, zero, mask=last & (g * 0 + used_bytes + k < chunk_bytes))


@triton.jit
def _compress_kernel(
    x_ptr, q_ptr, s_ptr, h_ptr, sign_ptr,
    numel, num_groups, gpc, chunk_bytes, used_bytes,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, ADAPTIVE: tl.constexpr,
    ZERO_NONFINITE: tl.constexpr, DOT_MODE: tl.constexpr, EMULATE_ROUND: tl.constexpr,
):
    NSUB: tl.constexpr = G // SUB
    g, g_mask = _group_ids(BG, num_groups)
    base = g[:, None] * G  # first input index of each group, [BG, 1]
    h = _load_square(h_ptr, SUB)
    # y_j: sub-block j of H_G x (H_NSUB (x) H_SUB as dense products plus butterflies)
    if NSUB == 1:
        y0 = _t1(x_ptr, base, numel, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    elif NSUB == 2:
        y0, y1 = _t2(x_ptr, base, numel, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    elif NSUB == 4:
        y0, y1, y2, y3 = _t4(x_ptr, base, numel, sign_ptr, h, 0, SUB, HADAMARD, SIGNS, ZERO_NONFINITE, DOT_MODE)
    else:
        y0, y1, y2, y3, y4, y5, y6, y7 = _t8(x_ptr, base, numel, sign_ptr, h, SUB, HADAMARD, SIGNS,
                                             ZERO_NONFINITE, DOT_MODE)
    NORM: tl.constexpr = G**-0.5 if HADAMARD else 1.0
    amax = tl.zeros((BG,), tl.float32)
    sumsq = tl.zeros((BG,), tl.float32)
    y0 = y0 * NORM
    amax, sumsq = _row_stats(y0, amax, sumsq, DUAL and ADAPTIVE)
    if NSUB >= 2:
        y1 = y1 * NORM
        amax, sumsq = _row_stats(y1, amax, sumsq, DUAL and ADAPTIVE)
    if NSUB >= 4:
        y2 = y2 * NORM
        y3 = y3 * NORM
        amax, sumsq = _row_stats(y2, amax, sumsq, DUAL and ADAPTIVE)
        amax, sumsq = _row_stats(y3, amax, sumsq, DUAL and ADAPTIVE)
    if NSUB >= 8:
        y4 = y4 * NORM
        y5 = y5 * NORM
        y6 = y6 * NORM
        y7 = y7 * NORM
        amax, sumsq = _row_stats(y4, amax, sumsq, DUAL and ADAPTIVE)
        amax, sumsq = _row_stats(y5, amax, sumsq, DUAL and ADAPTIVE)
        amax, sumsq = _row_stats(y6, amax, sumsq, DUAL and ADAPTIVE)
        amax, sumsq = _row_stats(y7, amax, sumsq, DUAL and ADAPTIVE)
    bad = tl.zeros((BG,), tl.int1)
    a, s, inv, bad = _scales(amax, sumsq, bad, G, QMAX, DUAL, ADAPTIVE)
    offs = _payload_offsets(g, gpc, chunk_bytes, G)[:, None] + tl.arange(0, SUB)[None, :]
    mask = g_mask[:, None]
    _store_payload(q_ptr, offs, y0, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
    if NSUB >= 2:
        _store_payload(q_ptr, offs + SUB, y1, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
    if NSUB >= 4:
        _store_payload(q_ptr, offs + 2 * SUB, y2, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
        _store_payload(q_ptr, offs + 3 * SUB, y3, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
    if NSUB >= 8:
        _store_payload(q_ptr, offs + 4 * SUB, y4, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
        _store_payload(q_ptr, offs + 5 * SUB, y5, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
        _store_payload(q_ptr, offs + 6 * SUB, y6, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
        _store_payload(q_ptr, offs + 7 * SUB, y7, a, inv, bad, mask, FMT, QMAX, DUAL, EMULATE_ROUND)
    _store_scales(s_ptr, g, g_mask, s, a, gpc, chunk_bytes, G, DUAL)
    _store_padding(q_ptr, g, g_mask, gpc, chunk_bytes, used_bytes)


@triton.jit
def _d1(q_ptr, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    """Payload sub-block j as fp32 [BG, SUB], times H_SUB (one bf16 product: exact operands)."""
    q = tl.load(q_ptr + offs + j * SUB, mask=g_mask[:, None]).to(tl.float32)
    if HADAMARD:
        q = _dot(q, h, 0 if DOT_MODE == 0 else 3)
    return q


@triton.jit
def _d2(q_ptr, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    a = _d1(q_ptr, offs, g_mask, h, j, SUB, HADAMARD, DOT_MODE)
    b = _d1(q_ptr, offs, g_mask, h, j + 1, SUB, HADAMARD, DOT_MODE)
    if HADAMARD:
        a, b = _butterfly2(a, b)
    return a, b


@triton.jit
def _d4(q_ptr, offs, g_mask, h, j: tl.constexpr, SUB: tl.constexpr, HADAMARD: tl.constexpr,
        DOT_MODE: tl.constexpr):
    a0, a1 = _d2(q_ptr, offs, g_mask, h, j, SUB, HADAMARD, DOT_MODE)
    b0, b1 = _d2(q_ptr, offs, g_mask, h, j + 2, SUB, HADAMARD, DOT_MODE)
    return _merge2(a0, a1, b0, b1, HADAMARD)


@triton.jit
def _d8(q_ptr, offs, g_mask, h, SUB: tl.constexpr, HADAMARD: tl.constexpr, DOT_MODE: tl.constexpr):
    a0, a1, a2, a3 = _d4(q_ptr, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
    b0, b1, b2, b3 = _d4(q_ptr, offs, g_mask, h, 4, SUB, HADAMARD, DOT_MODE)
    return _merge4(a0, a1, a2, a3, b0, b1, b2, b3, HADAMARD)


@triton.jit
def _store_decoded(out_ptr, base, numel, x, scale, sign_ptr, j: tl.constexpr, SUB: tl.constexpr,
                   SIGNS: tl.constexpr):
    cols = tl.arange(0, SUB)[None, :]
    x = x * scale[:, None]
    if SIGNS:
        x = x * tl.load(sign_ptr + j * SUB + cols)
    idx = base + j * SUB + cols
    tl.store(out_ptr + idx, x.to(out_ptr.dtype.element_ty), mask=idx < numel)


@triton.jit
def _decompress_kernel(
    q_ptr, s_ptr, out_ptr, h_ptr, sign_ptr,
    numel, num_groups, gpc, chunk_bytes,
    G: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, DOT_MODE: tl.constexpr,
):
    NSUB: tl.constexpr = G // SUB
    g, g_mask = _group_ids(BG, num_groups)
    so = _scale_offsets(g, gpc, chunk_bytes, G)
    scale = tl.load(s_ptr + so, mask=g_mask, other=0.0)
    if DUAL:
        scale = scale / tl.load(s_ptr + so + gpc, mask=g_mask, other=1.0)
    if HADAMARD:
        scale = scale * (G**-0.5)
    h = _load_square(h_ptr, SUB)
    offs = _payload_offsets(g, gpc, chunk_bytes, G)[:, None] + tl.arange(0, SUB)[None, :]
    base = g[:, None] * G
    # H_G = (H_NSUB (x) I)(I (x) H_SUB): the dense products first, on exact payload values
    if NSUB == 1:
        x0 = _d1(q_ptr, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
    elif NSUB == 2:
        x0, x1 = _d2(q_ptr, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
    elif NSUB == 4:
        x0, x1, x2, x3 = _d4(q_ptr, offs, g_mask, h, 0, SUB, HADAMARD, DOT_MODE)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _d8(q_ptr, offs, g_mask, h, SUB, HADAMARD, DOT_MODE)
    _store_decoded(out_ptr, base, numel, x0, scale, sign_ptr, 0, SUB, SIGNS)
    if NSUB >= 2:
        _store_decoded(out_ptr, base, numel, x1, scale, sign_ptr, 1, SUB, SIGNS)
    if NSUB >= 4:
        _store_decoded(out_ptr, base, numel, x2, scale, sign_ptr, 2, SUB, SIGNS)
        _store_decoded(out_ptr, base, numel, x3, scale, sign_ptr, 3, SUB, SIGNS)
    if NSUB >= 8:
        _store_decoded(out_ptr, base, numel, x4, scale, sign_ptr, 4, SUB, SIGNS)
        _store_decoded(out_ptr, base, numel, x5, scale, sign_ptr, 5, SUB, SIGNS)
        _store_decoded(out_ptr, base, numel, x6, scale, sign_ptr, 6, SUB, SIGNS)
        _store_decoded(out_ptr, base, numel, x7, scale, sign_ptr, 7, SUB, SIGNS)


@triton.jit
def _sum_kernel(
    q_ptr, s_ptr, out_q_ptr, out_s_ptr, input_stride,
    num_groups, gpc, chunk_bytes, used_bytes,
    P: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    DUAL: tl.constexpr, ADAPTIVE: tl.constexpr, EMULATE_ROUND: tl.constexpr,
):
    g, g_mask = _group_ids(BG, num_groups)
    offs = _payload_offsets(g, gpc, chunk_bytes, G)[:, None] + tl.arange(0, G)[None, :]
    so = _scale_offsets(g, gpc, chunk_bytes, G)
    z = tl.zeros((BG, G), dtype=tl.float32)
    bad = tl.zeros((BG,), dtype=tl.int1)
    stride = input_stride.to(tl.int64)  # bytes between inputs, a multiple of 4
    for p in tl.static_range(P):  # unrolled: all P loads in flight at once
        q = tl.load(q_ptr + p * stride + offs, mask=g_mask[:, None]).to(tl.float32)
        scale = tl.load(s_ptr + p * (stride // 4) + so, mask=g_mask, other=0.0)
        if DUAL:
            scale = scale / tl.load(s_ptr + p * (stride // 4) + so + gpc, mask=g_mask, other=1.0)
        bad = bad | (scale != scale)
        z += q * scale[:, None]
    amax = tl.zeros((BG,), tl.float32)
    sumsq = tl.zeros((BG,), tl.float32)
    amax, sumsq = _row_stats(z, amax, sumsq, DUAL and ADAPTIVE)
    a, s, inv, bad = _scales(amax, sumsq, bad, G, QMAX, DUAL, ADAPTIVE)
    _store_payload(out_q_ptr, offs, z, a, inv, bad, g_mask[:, None], FMT, QMAX, DUAL, EMULATE_ROUND)
    _store_scales(out_s_ptr, g, g_mask, s, a, gpc, chunk_bytes, G, DUAL)
    _store_padding(out_q_ptr, g, g_mask, gpc, chunk_bytes, used_bytes)


# --- host side ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _matrices_cpu(group_size: int, random_signs: bool, seed: int):
    sub = min(group_size, SUB_MAX)
    signs = sign_vector(group_size, seed) if random_signs else torch.ones(group_size)
    return hadamard_matrix(sub).contiguous(), signs


_matrix_cache: dict[tuple, tuple] = {}


def _matrices(config: TacoConfig, device: torch.device):
    key = (config.group_size, config.random_signs, config.sign_seed, str(device))
    if key not in _matrix_cache:
        cpu = _matrices_cpu(config.group_size, config.random_signs, config.sign_seed)
        _matrix_cache[key] = tuple(t.to(device) for t in cpu)
    return _matrix_cache[key]


@functools.lru_cache(maxsize=4096)
def _launch(layout: WireLayout, group_size: int, block_elems: int) -> tuple[tuple, dict]:
    """Grid and the launch arguments every kernel shares (cached: launches are on the hot path)."""
    bg = max(16, min(block_elems // group_size, 256))
    grid = (triton.cdiv(layout.num_groups, bg),)
    return grid, dict(num_groups=layout.num_groups, gpc=layout.groups_per_chunk,
                      chunk_bytes=layout.chunk_bytes, G=group_size, BG=bg)


def _dot_mode(exact_in_bf16: bool) -> int:
    if _interpreting():
        return DOT_FP32
    mode = TUNING["dot_mode"]
    return DOT_BF16 if exact_in_bf16 and mode == DOT_BF16X2 else mode


def compress_into(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout, config: TacoConfig) -> None:
    """Encode the flat tensor ``x`` into ``buffer``; same contract as the reference."""
    x = x.contiguous()
    h, signs = _matrices(config, x.device)
    grid, common = _launch(layout, config.group_size, TUNING["block_elems"])
    _compress_kernel[grid](
        x, buffer.view(PAYLOAD_DTYPES[config.format]), buffer.view(torch.float32), h, signs,
        layout.numel, **common, used_bytes=layout.used_bytes, SUB=min(config.group_size, SUB_MAX),
        FMT=FMT_CODE[config.format], QMAX=config.qmax, HADAMARD=config.hadamard,
        SIGNS=config.random_signs, DUAL=config.scales == "dual", ADAPTIVE=config.adaptive_scale,
        ZERO_NONFINITE=config.nonfinite == "zero", DOT_MODE=_dot_mode(x.dtype == torch.bfloat16),
        EMULATE_ROUND=_interpreting(), num_warps=TUNING["num_warps"],
    )


def decompress_into(buffer: torch.Tensor, layout: WireLayout, config: TacoConfig, out: torch.Tensor) -> None:
    """Decode ``buffer`` into the flat contiguous tensor ``out``."""
    h, signs = _matrices(config, buffer.device)
    grid, common = _launch(layout, config.group_size, TUNING["block_elems"])
    _decompress_kernel[grid](
        buffer.view(PAYLOAD_DTYPES[config.format]), buffer.view(torch.float32), out, h, signs,
        layout.numel, **common, SUB=min(config.group_size, SUB_MAX),
        HADAMARD=config.hadamard, SIGNS=config.random_signs, DUAL=config.scales == "dual",
        DOT_MODE=_dot_mode(True), num_warps=TUNING["num_warps"],
    )


def sum_into(stacked: torch.Tensor, layout: WireLayout, config: TacoConfig, out: torch.Tensor) -> None:
    """Dequantise, sum and requantise the P buffers of ``stacked`` [P, total_bytes] into ``out``."""
    grid, common = _launch(layout, config.group_size, TUNING["block_elems"])
    fmt_dtype = PAYLOAD_DTYPES[config.format]
    _sum_kernel[grid](
        stacked.view(fmt_dtype), stacked.view(torch.float32), out.view(fmt_dtype), out.view(torch.float32),
        stacked.stride(0), **common, used_bytes=layout.used_bytes, P=stacked.shape[0],
        FMT=FMT_CODE[config.format], QMAX=config.qmax, DUAL=config.scales == "dual",
        ADAPTIVE=config.adaptive_scale, EMULATE_ROUND=_interpreting(), num_warps=TUNING["num_warps"],
    )
