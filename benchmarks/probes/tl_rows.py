"""Run 10 probe kernels in Triton's block language: one group per thread (the Gluon probe's
structure, `gluon_rows.py`), with every setting of the codec, built from the committed helpers.

The whole tile [BG, G] is loaded at once (coalesced: Triton's coalescing pass gives each lane 16
bytes of a row), and the transform runs as log2(G) butterfly stages by reshape / split / join;
the compiler moves the values to the layout the stages need (through shared memory).
Persistent like the committed kernels (programs walk the tiles; NUM_STAGES tiles in flight)
or one program per tile (grid = tiles).
"""
import triton
import triton.language as tl

from taco_accel.codec.triton_kernels import (_chunk_tile, _payload_offsets, _row_stats, _scale_offsets, _scales,
                                             _store_padding, _store_payload, _store_scales, _tile_values)


@triton.jit
def _stage(x, BG: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    # one butterfly stage on each row: pairs (i, i + H) inside blocks of 2H values, sum first
    x = tl.reshape(x, (BG, G // (2 * H), 2, H))
    a, b = tl.split(tl.permute(x, (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BG, G))


@triton.jit
def _walsh_rows(y, BG: tl.constexpr, G: tl.constexpr):
    # Sylvester H_G on each row of y [BG, G], unnormalised, stride 1 first (the reference's sums)
    for i in tl.static_range(G.bit_length() - 1):
        y = _stage(y, BG, G, 1 << i)
    return y


@triton.jit
def compress_rows_kernel(
    x_ptr, q_ptr, s_ptr, sign_ptr, numel, chunks, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, BG: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr, ADAPTIVE: tl.constexpr,
    ZERO_NONFINITE: tl.constexpr, EMULATE_ROUND: tl.constexpr, PAD: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):
        c, r0, g_mask = _chunk_tile(tile, tiles_per_chunk, gpc, BG)
        x_blk, offs, left = _tile_values(x_ptr, c, r0, gpc, numel, G, G, BG)  # past numel: zeros
        x = tl.load(x_blk + offs, mask=offs < left, other=0.0)
        if ZERO_NONFINITE:
            x = tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)
        y = x.to(tl.float32)
        if SIGNS:
            y = y * tl.load(sign_ptr + tl.arange(0, G))[None, :]
        if HADAMARD:
            y = _walsh_rows(y, BG, G)
        amax, sumsq = _row_stats(y, tl.zeros((BG,), tl.float32), tl.zeros((BG,), tl.float32), DUAL and ADAPTIVE)
        NORM: tl.constexpr = G**-0.5 if HADAMARD else 1.0
        a, s, mult, bad = _scales(amax, sumsq, tl.zeros((BG,), tl.int1), NORM, G, QMAX, DUAL, ADAPTIVE)
        _store_payload(q_ptr + _payload_offsets(c, r0, chunk_bytes, G), offs, y, mult, bad, g_mask[:, None],
                       FMT, QMAX, EMULATE_ROUND)
        _store_scales(s_ptr, c, r0, g_mask, s, a, gpc, chunk_bytes, G, BG, DUAL)
        _store_padding(q_ptr, c, r0, gpc, chunk_bytes, PAD, BG)


@triton.jit
def decompress_rows_kernel(
    q_ptr, s_ptr, out_ptr, sign_ptr, numel, chunks, gpc, chunk_bytes, tiles_per_chunk,
    G: tl.constexpr, BG: tl.constexpr, HADAMARD: tl.constexpr, SIGNS: tl.constexpr, DUAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):
        c, r0, g_mask = _chunk_tile(tile, tiles_per_chunk, gpc, BG)
        s_blk = s_ptr + _scale_offsets(c, r0, gpc, chunk_bytes, G, BG)
        scale = tl.load(s_blk, mask=g_mask, other=0.0)
        if DUAL:
            scale = scale / tl.load(s_blk + gpc, mask=g_mask, other=1.0)
        out_blk, offs, left = _tile_values(out_ptr, c, r0, gpc, numel, G, G, BG)
        y = tl.load(q_ptr + _payload_offsets(c, r0, chunk_bytes, G) + offs, mask=g_mask[:, None]).to(tl.float32)
        if HADAMARD:
            y = _walsh_rows(y, BG, G)
            scale = scale * (G**-0.5)
        y = y * scale[:, None]
        if SIGNS:
            y = y * tl.load(sign_ptr + tl.arange(0, G))[None, :]
        tl.store(out_blk + offs, y.to(out_blk.dtype.element_ty), mask=offs < left)
