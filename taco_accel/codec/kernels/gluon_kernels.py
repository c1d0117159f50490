"""Compress and decompress with one group per thread, in Gluon (Triton's language with explicit
layouts): the formulas of `reference`, for G <= `MAX_GROUP` on NVIDIA GPUs (`..dispatch` says
when these run instead of `triton_kernels`; the CPU interpreter cannot run Gluon).

Each thread holds a whole group in registers and transforms it with log2(G) butterfly stages (G/2
adds and G/2 subtracts each, in the reference's order: stride 1 first): no tensor-core products,
no cross-lane reductions (but for the split groups below) and no software pipeline; a warp codes
32 groups per program, and the many independent one-warp programs an SM holds keep its loads in
flight. Memory is touched in layouts where a warp covers whole rows, 16 bytes per lane; the tile
crosses shared memory once each way into the layout where a thread holds its group. Triton's
block language can state the same arithmetic but places values on lanes itself, and then
converts layouts between the butterfly stages.

The encoder reads bf16 input as int32 words (two values each: the pair of the first butterfly),
which saves the packing and unpacking of 16-bit values around the layout change, and writes a
bad group's zeros under a branch that no warp without one takes (instead of a select on every
value). With few waves of programs (up to `Tuning.split_max_groups` groups of 128) it splits each
group over lanes (`split_schedule`): 2 lanes of 64 values, the last butterfly stage between them
by shuffles, and 4 lanes in the kernel's first and last waves, whose warps then issue fewer
instructions while their tiles are the only ones in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import CodecConfig
from ..hadamard import device_signs
from ..layout import FORMAT_CODES, PAYLOAD_DTYPES, WireLayout, signed_header
from ..tuning import Tuning
from .reference import ADAPTIVE_EPS, ADAPTIVE_MAX, ADAPTIVE_MIN, FP16_MAX, TINY_AMAX

try:  # experimental in triton; written for its API in 3.6 and 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    AVAILABLE = hasattr(gl, "BlockedLayout") and hasattr(gluon, "constexpr_function")  # fixed at import
except ImportError:  # pragma: no cover - old triton: the tensor-core kernels code every group size
    AVAILABLE = False

# A group's G fp32 values live in one thread's registers: at G = 128 the kernels take 158-167 of
# the 255 a thread may have; G = 256 cannot fit.
MAX_GROUP = 128

if AVAILABLE:

    @gluon.constexpr_function
    def _coalesced(group_size, warps, elem_bytes):
        """Rows [32 * warps, G] of ``elem_bytes``-byte values, 16 bytes per lane, whole rows per warp."""
        vec = 16 // elem_bytes
        lanes = min(group_size // vec, 32)
        return gl.BlockedLayout([1, vec], [32 // lanes, lanes], [warps, 1], [1, 0])

    @gluon.jit
    def _stage(x, ROWS: gl.constexpr, G: gl.constexpr, H: gl.constexpr):
        """One butterfly stage on each row: pairs (i, i + H) inside blocks of 2H values, sum first."""
        x = gl.reshape(x, [ROWS, G // (2 * H), 2, H])
        a, b = gl.split(gl.permute(x, [0, 1, 3, 2]))
        return gl.reshape(gl.permute(gl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, G])

    @gluon.constexpr_function
    def _butterfly_shuffle(xor):
        return f"shfl.sync.bfly.b32 $0, $1, {xor}, 31, -1;"

    @gluon.jit
    def _cross_lane_stage(y, L_ROW: gl.constexpr, ROWS: gl.constexpr, J: gl.constexpr):
        """The butterfly stage whose pairs sit at the same registers of lanes lane and lane ^ 2^J:
        the partner's value by a butterfly shuffle, then ``sign * own + partner`` in one fma (sign
        -1 in the lane holding the pair's second value: a - b, rounded once as the add is)."""
        one_per_thread = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
        lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [one_per_thread], dtype=gl.int32,
                                         is_pure=True, pack=1)
        sign = 1.0 - 2.0 * ((lane >> J) & 1).to(gl.float32)
        partner = gl.inline_asm_elementwise(_butterfly_shuffle(1 << J), "=f,f", [y], dtype=gl.float32,
                                            is_pure=True, pack=1)
        return gl.fma(y, sign[:, None], partner)

    @gluon.jit
    def _walsh(y, L_ROW: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr, FIRST: gl.constexpr,
               LANES: gl.constexpr = 1):
        """``y @ H_G`` for the rows of y (unnormalised, Sylvester order); FIRST: how many stages
        (stride 1, 2, ...) y has been through already. A row lies in LANES lanes (G / LANES
        consecutive values each): the first stages run in each lane's registers, the last
        log2(LANES) between lanes, in the reference's order throughout."""
        for i in gl.static_range(FIRST, (G // LANES).bit_length() - 1):
            y = _stage(y, ROWS, G, 1 << i)
        y = gl.convert_layout(y, L_ROW)  # the stages only renumbered registers
        for j in gl.static_range(LANES.bit_length() - 1):
            y = _cross_lane_stage(y, L_ROW, ROWS, j)
        return y

    @gluon.jit
    def _tile_origin(ROWS: gl.constexpr, WIDE: gl.constexpr):
        """(chunk c, first row r0) of this program's tile; grid (tiles of a chunk, chunks). 64-bit
        where a buffer passes 2 GiB (WIDE), else 32-bit: 64-bit arithmetic before the first load
        delays every program's first request to memory."""
        c = gl.program_id(1)
        r0 = gl.program_id(0) * ROWS
        if WIDE:
            c = c.to(gl.int64)
            r0 = r0.to(gl.int64)
        return c, r0

    @gluon.jit
    def decompress_rows_kernel(
        q_ptr, s_ptr, out_ptr, sign_ptr, numel, gpc, chunk_bytes,
        G: gl.constexpr, NW: gl.constexpr, Q_BYTES: gl.constexpr, OUT_BYTES: gl.constexpr,
        HADAMARD: gl.constexpr, SIGNS: gl.constexpr, DUAL: gl.constexpr, CHUNKED: gl.constexpr,
        WIDE: gl.constexpr,
    ):
        """Decode groups r0.. (32 * NW of them, one per thread) of chunk c; the grid is (tiles of a
        chunk, chunks), so no tile index is divided on the way to the first load. Offsets are
        32-bit unless the buffer or the output passes 2 GiB (WIDE)."""
        ROWS: gl.constexpr = 32 * NW
        L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
        L_Q: gl.constexpr = _coalesced(G, NW, Q_BYTES)
        L_OUT: gl.constexpr = _coalesced(G, NW, OUT_BYTES)
        c, r0 = _tile_origin(ROWS, WIDE)
        if CHUNKED:  # chunk c's payload, scales and values
            q_ptr += c * chunk_bytes
            s_ptr += c * (chunk_bytes // 4)
            out_ptr += c * gpc * G

        q_rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Q))
        q = gl.load(q_ptr + (q_rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]),
                    mask=(q_rows < gpc)[:, None])
        s_rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
        scale = gl.load(s_ptr + gpc * (G // 4) + s_rows, mask=s_rows < gpc, other=0.0)  # the layout's scale[0]
        if DUAL:
            scale = scale / gl.load(s_ptr + gpc * (G // 4 + 1) + s_rows, mask=s_rows < gpc, other=1.0)

        y = gl.convert_layout(q, L_ROW).to(gl.float32)  # the payload's bytes cross shared memory
        if HADAMARD:
            y = _walsh(y, L_ROW, ROWS, G, 0)
            scale = scale * (G**-0.5)
        y = y * scale[:, None]
        if out_ptr.dtype.element_ty == gl.float16:  # saturate: a decoded value past 65504 is not inf
            # min / max, not gl.clamp (absent from triton 3.6's Gluon); NaN passes through both
            y = gl.minimum(gl.maximum(y, -_FP16_MAX, propagate_nan=tl.PropagateNan.ALL), _FP16_MAX,
                           propagate_nan=tl.PropagateNan.ALL)
        x = gl.convert_layout(y.to(out_ptr.dtype.element_ty), L_OUT)

        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_OUT))
        cols = gl.arange(0, G, layout=gl.SliceLayout(0, L_OUT))
        offs = rows[:, None] * G + cols[None, :]
        if SIGNS:  # +-1: exact in the output type
            x = x * gl.load(sign_ptr + cols).to(out_ptr.dtype.element_ty)[None, :]
        if CHUNKED:  # values past the input's end are padding; rows past gpc, the next chunk's
            mask = (offs < numel - c * gpc * G) & (rows < gpc)[:, None]
        else:
            mask = offs < numel
        gl.store(out_ptr + offs, x, mask=mask)


    # the reference's constants, as compile-time values the kernels may read
    _EPS = tl.constexpr(ADAPTIVE_EPS)
    _A_MIN = tl.constexpr(ADAPTIVE_MIN)
    _A_MAX = tl.constexpr(ADAPTIVE_MAX)
    _TINY = tl.constexpr(TINY_AMAX)
    _FP16_MAX = tl.constexpr(FP16_MAX)
    # the names of triton 3.9, else of 3.6 (an H200's)
    _barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier")

    @gluon.constexpr_function
    def _swizzled(elem_bytes):
        """Shared rows whose 16-byte pieces are permuted by row % 8: a lane reading its own row and
        a warp writing whole rows both hit 8 different bank groups per 8 lanes."""
        return gl.SwizzledSharedLayout(16 // elem_bytes, 1, 8, [1, 0])

    @gluon.jit
    def _through_shared(x, layout: gl.constexpr, ELEM_BYTES: gl.constexpr):
        """``x`` in ``layout``, by 16-byte stores and loads through a shared tile of its own.
        `gl.convert_layout` would go through a smaller scratch in rounds, with register moves to
        gather each 16-byte store."""
        tile = gl.allocate_shared_memory(x.dtype, x.shape, _swizzled(ELEM_BYTES), x)
        _barrier()
        return tile.load(layout)

    @gluon.jit
    def _finite_or_zero(v):
        return gl.where(gl.abs(v) < float("inf"), v, 0.0)

    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _store_tail(q_ptr, r0, gpc, chunk_bytes, NW: gl.constexpr, TAIL: gl.constexpr, HEADER: gl.constexpr,
                    LANES: gl.constexpr = 1):
        """Write the chunk's TAIL (4, 8, 12 or 16) last bytes, the 4-byte header (HEADER, as in
        `triton_kernels._store_tail`) then zeros, from the program whose rows r0.. (32 * NW / LANES of
        them) hold its last group."""
        L_TAIL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        k = gl.arange(0, 16, layout=L_TAIL)
        byte = gl.where(k < 4, (gl.full([16], HEADER, gl.int32, L_TAIL) >> (8 * k)) & 0xFF, 0).to(gl.uint8)
        last = (r0 + 32 * NW // LANES >= gpc).to(gl.int32)
        gl.store(q_ptr + chunk_bytes - TAIL + k, byte.to(q_ptr.dtype.element_ty, bitcast=True), mask=k < TAIL * last)

    @gluon.jit
    def _encode_rows(
        x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, r0,
        G: gl.constexpr, NW: gl.constexpr, X_BYTES: gl.constexpr, WORDS: gl.constexpr, FMT: gl.constexpr,
        QMAX: gl.constexpr, HADAMARD: gl.constexpr, SIGNS: gl.constexpr, DUAL: gl.constexpr,
        ADAPTIVE: gl.constexpr, ZERO_NONFINITE: gl.constexpr, CHUNKED: gl.constexpr, TAIL: gl.constexpr,
        HEADER: gl.constexpr, LANES: gl.constexpr, MASKED: gl.constexpr,
    ):
        """Encode groups r0.. (32 * NW / LANES of them, each in LANES lanes) of chunk c. WORDS:
        bf16 input read as int32 words (x_ptr, numel: words), two values each, which a shift and
        a mask make fp32; the two are the first butterfly's pair (loaded as bf16, 16-bit values
        would be packed and unpacked around the layout change). MASKED=False: every row is a
        whole group of the input, read and written without bounds masks."""
        ROWS: gl.constexpr = 32 * NW // LANES
        L_ROW: gl.constexpr = gl.BlockedLayout([1, G // LANES], [32 // LANES, LANES], [NW, 1], [1, 0])
        L_Q: gl.constexpr = _coalesced(G, NW, 1)
        if WORDS:
            V: gl.constexpr = G // 2  # loaded values (words) per group
            L_V: gl.constexpr = gl.BlockedLayout([1, V // LANES], [32 // LANES, LANES], [NW, 1], [1, 0])
            L_X: gl.constexpr = _coalesced(V, NW, 4)
        else:
            V: gl.constexpr = G
            L_V: gl.constexpr = L_ROW
            L_X: gl.constexpr = _coalesced(G, NW, X_BYTES)
        left = numel  # values (words) of x from the chunk's first on
        if CHUNKED:
            x_ptr += c * gpc * V
            q_ptr += c * chunk_bytes
            s_ptr += c * (chunk_bytes // 4)
            left = numel - c * gpc * V

        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_X))
        cols = gl.arange(0, V, layout=gl.SliceLayout(0, L_X))
        offs = rows[:, None] * V + cols[None, :]
        if MASKED:
            mask = offs < left  # past the input's end: zeros, the padding of the last group
            if CHUNKED:  # rows past gpc are the next chunk's
                mask = mask & (rows < gpc)[:, None]
            x = gl.load(x_ptr + offs, mask=mask, other=0)
        else:
            x = gl.load(x_ptr + offs)
        if SIGNS:  # +-1 before the transform: a flipped sign bit, exact
            if WORDS:
                lo = gl.where(gl.load(sign_ptr + 2 * cols) < 0, 0x8000, 0)
                x = x ^ (lo | gl.where(gl.load(sign_ptr + 2 * cols + 1) < 0, -2147483648, 0))[None, :]
            else:
                x = x * gl.load(sign_ptr + cols).to(x.dtype)[None, :]
        x = _through_shared(x, L_V, 4 if WORDS else X_BYTES)
        if WORDS:
            lo = (x << 16).to(gl.float32, bitcast=True)  # value 2k: the word's low half
            hi = (x & -65536).to(gl.float32, bitcast=True)  # value 2k + 1
        else:
            y = x.to(gl.float32)
        if ZERO_NONFINITE:
            if WORDS:
                lo = _finite_or_zero(lo)
                hi = _finite_or_zero(hi)
            else:
                y = _finite_or_zero(y)
        if HADAMARD:
            if WORDS:  # stage 1 on each word's pair, then the rest
                y = _walsh(gl.reshape(gl.join(lo + hi, lo - hi), [ROWS, G]), L_ROW, ROWS, G, 1, LANES)
            else:
                y = _walsh(y, L_ROW, ROWS, G, 0, LANES)
        elif WORDS:
            y = gl.convert_layout(gl.reshape(gl.join(lo, hi), [ROWS, G]), L_ROW)

        # the scales: `reference.requantize` with the transform's 1 / sqrt(G) folded in (NORM)
        NORM: gl.constexpr = G**-0.5 if HADAMARD else 1.0
        amax = gl.reduce(gl.abs(y), 1, _max_nan) * NORM
        if DUAL and ADAPTIVE:
            rms = gl.sqrt_rn(gl.sum(y * y, axis=1) * (NORM * NORM) / G + _EPS)
            a = gl.minimum(gl.maximum(gl.div_rn(QMAX, rms), _A_MIN), _A_MAX)
            amax = amax * a  # == max |a * y|: scaling by a > 0 commutes with rounding and max
        bad = (amax != amax) | (amax == float("inf"))  # NaN or Inf in the group, or an overflow
        big = amax >= _TINY
        s = gl.where(bad, float("nan"), gl.where(big, gl.div_rn(amax, QMAX), 0.0))
        mult = gl.where(big & (~bad), gl.div_rn(QMAX, gl.where(big, amax, 1.0)), 0.0)
        if DUAL and ADAPTIVE:
            a = gl.where(bad, 1.0, a)
            mult = mult * a
        elif DUAL:
            a = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, L_ROW))
        q = y * (mult * NORM)[:, None]  # a bad group: 0, or NaN where y is not finite (zeroed below)
        if FMT == 2:  # int8: clamp, round half to even (1.5 * 2**23 holds no fraction bits)
            q = gl.minimum(gl.maximum(q, -QMAX), QMAX)
            q = ((q + 12582912.0) - 12582912.0).to(gl.int8)
        else:
            q = q.to(q_ptr.dtype.element_ty)  # saturating conversion
        q = _through_shared(q, L_Q, 1)

        q_rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Q))
        q_offs = q_rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]
        if MASKED:
            gl.store(q_ptr + q_offs, q, mask=(q_rows < gpc)[:, None])
        else:
            gl.store(q_ptr + q_offs, q)
        if gl.max(bad.to(gl.int32), axis=0) > 0:  # rare: zeros over the bad groups' payload, not a
            bad_q = gl.convert_layout(bad, gl.SliceLayout(1, L_Q))  # select on every value
            zero = gl.zeros([ROWS, G], gl.float32, L_Q).to(q_ptr.dtype.element_ty)
            gl.store(q_ptr + q_offs, zero, mask=(bad_q & (q_rows < gpc))[:, None])
        s_rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
        gl.store(s_ptr + gpc * (G // 4) + s_rows, s, mask=s_rows < gpc)
        if DUAL:
            gl.store(s_ptr + gpc * (G // 4 + 1) + s_rows, a, mask=s_rows < gpc)
        _store_tail(q_ptr, r0, gpc, chunk_bytes, NW, TAIL, HEADER, LANES)

    @gluon.jit
    def compress_rows_kernel(
        x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, head, body,
        G: gl.constexpr, NW: gl.constexpr, X_BYTES: gl.constexpr, WORDS: gl.constexpr, FMT: gl.constexpr,
        QMAX: gl.constexpr, HADAMARD: gl.constexpr, SIGNS: gl.constexpr, DUAL: gl.constexpr,
        ADAPTIVE: gl.constexpr, ZERO_NONFINITE: gl.constexpr, CHUNKED: gl.constexpr, WIDE: gl.constexpr,
        TAIL: gl.constexpr, HEADER: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """Grid (programs of a chunk, chunks) as in the decoder. Without SPLIT a program encodes
        32 * NW groups, one a lane. SPLIT (G = 128, `split_schedule`): a chunk's first ``head``
        groups go 8 a program over 4 lanes, the next ``body`` 16 a program over 2 lanes, the rest
        8 a program over 4 lanes again; head and body are whole groups of the input (no masks)."""
        if SPLIT:
            c, p = _tile_origin(1, WIDE)
            first = head // 8  # the body's first program
            if (p >= first) & (p < first + body // 16):
                _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, head + (p - first) * 16, G,
                             NW, X_BYTES, WORDS, FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED,
                             TAIL, HEADER, 2, False)
            else:  # the head's and the tail's programs: one code, with masks
                r0 = gl.where(p < first, p * 8, head + body + (p - first - body // 16) * 8)
                _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, r0, G, NW, X_BYTES, WORDS,
                             FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED, TAIL, HEADER, 4, True)
        else:
            c, r0 = _tile_origin(32 * NW, WIDE)
            _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, r0, G, NW, X_BYTES, WORDS, FMT,
                         QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED, TAIL, HEADER, 1, True)


def _register_cap(cap: int | None) -> dict:
    return {} if cap is None else {"maxnreg": cap}


def _grid(layout: WireLayout, tuning: Tuning) -> tuple[int, int]:
    """(tiles of a chunk, chunks): a program per tile of 32 groups a warp."""
    return max(1, triton.cdiv(layout.groups_per_chunk, 32 * tuning.rows_warps)), layout.chunks


def whole_groups(layout: WireLayout, chunk: int) -> int:
    """How many of ``chunk``'s groups are whole groups of the input (read without masks)."""
    gpc, g = layout.groups_per_chunk, layout.group_size
    return max(0, min(gpc, (layout.numel - chunk * gpc * g) // g))


def split_schedule(layout: WireLayout, sms: int, tuning: Tuning) -> tuple[int, int, int]:
    """(head, body, programs) of each chunk for the split encoder on a GPU of ``sms`` SMs: the
    kernel's first ``tuning.split_head_waves`` and last ``split_tail_waves`` waves of programs (a
    wave: SMs * ``split_warps_per_sm`` programs) code 8 groups over 4 lanes, shared out over the
    chunks; the ``head`` first groups of a chunk and the ``body`` next, 16 a program over 2 lanes,
    are multiples of 16 whole groups of the input (read and written without masks)."""
    gpc = layout.groups_per_chunk
    whole = whole_groups(layout, layout.chunks - 1)  # the last chunk has the fewest
    wave = sms * tuning.split_warps_per_sm * 8 / layout.chunks  # groups of a wave of 4-lane programs, a chunk's share
    head = min(int(tuning.split_head_waves * wave), whole) // 16 * 16
    body = max(0, min(gpc - int(tuning.split_tail_waves * wave), whole) - head) // 16 * 16
    return head, body, max(1, head // 8 + body // 16 + triton.cdiv(gpc - head - body, 8))


def _wide(layout: WireLayout, values: torch.Tensor) -> bool:
    """Whether the buffer or the chunks' ``values`` pass 2 GiB (64-bit offsets)."""
    return max(layout.total_bytes, layout.padded_numel * values.element_size()) >= 2**31


def decompress_rows_into(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
                         tuning: Tuning) -> None:
    """Decode ``buffer`` into the flat contiguous tensor ``out``; G <= `MAX_GROUP`, CUDA only."""
    payload = buffer.view(PAYLOAD_DTYPES[config.format])
    warps = tuning.rows_warps
    decompress_rows_kernel[_grid(layout, tuning)](
        payload, buffer.view(torch.float32), out, device_signs(config, buffer.device),
        layout.numel, layout.groups_per_chunk, layout.chunk_bytes,
        G=config.group_size, NW=warps, Q_BYTES=payload.element_size(), OUT_BYTES=out.element_size(),
        HADAMARD=config.hadamard, SIGNS=config.random_signs, DUAL=config.scales == "dual",
        CHUNKED=layout.chunks > 1, WIDE=_wide(layout, out), num_warps=warps,
        **_register_cap(tuning.rows_decompress_registers),
    )


def reads_words(x: torch.Tensor) -> bool:
    """Whether bf16 ``x`` (flat, contiguous) can be read as int32 words: whole words, 4-byte aligned."""
    return (x.dtype == torch.bfloat16 and x.numel() % 2 == 0 and x.data_ptr() % 4 == 0
            and x.storage_offset() % 2 == 0)  # what `Tensor.view(torch.int32)` asks


def compress_rows_into(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout, config: CodecConfig,
                       tuning: Tuning, split_sms: int = 0) -> None:
    """Encode the flat contiguous tensor ``x`` into ``buffer``; G <= `MAX_GROUP`, CUDA only.
    ``split_sms`` > 0 (G = 128): groups over 2 and 4 lanes (`split_schedule`) for a GPU of that
    many SMs; else a group a lane."""
    words = reads_words(x)
    values = x.view(torch.int32) if words else x
    warps = tuning.rows_warps
    if split_sms:
        head, body, programs = split_schedule(layout, split_sms, tuning)
        grid, launch = (programs, layout.chunks), {"maxnreg": tuning.split_registers}
    else:
        head, body, grid, launch = 0, 0, _grid(layout, tuning), _register_cap(tuning.rows_compress_registers)
    compress_rows_kernel[grid](
        values, buffer.view(PAYLOAD_DTYPES[config.format]), buffer.view(torch.float32),
        device_signs(config, buffer.device), values.numel(), layout.groups_per_chunk, layout.chunk_bytes, head, body,
        G=config.group_size, NW=warps, X_BYTES=x.element_size(), WORDS=words, FMT=FORMAT_CODES[config.format],
        QMAX=config.qmax, HADAMARD=config.hadamard, SIGNS=config.random_signs, DUAL=config.scales == "dual",
        ADAPTIVE=config.adaptive_scale, ZERO_NONFINITE=config.nonfinite == "zero", CHUNKED=layout.chunks > 1,
        WIDE=_wide(layout, x), TAIL=layout.tail_bytes, HEADER=signed_header(config), SPLIT=split_sms > 0, num_warps=warps,
        **launch,
    )
