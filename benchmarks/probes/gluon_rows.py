"""Run 10 probe kernels (Gluon): one group per thread, the transform as butterflies in registers,
loads and stores coalesced through shared memory.

The run 9 register probe did the same arithmetic but let Triton's block language place values on
threads: its loads and stores came out one row per lane, 16 bytes each, 32 rows per warp
instruction (0.28-0.59 of copy bandwidth). Here the layouts are explicit: memory is touched in
layouts where a warp covers whole rows (16 bytes per lane), and one `convert_layout` each way
moves the tile through shared memory to the layout where a thread holds a whole group.

Single chunk (padding bytes zeroed), single scale, no signs: the default config, enough to time
the idea. The butterflies and layouts are the library decoder's (`codec/gluon_kernels.py`).
The ring kernels copy with `async_copy_global_to_shared` (triton 3.6) or `async_load` (3.9).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from taco_accel.codec.gluon_kernels import _barrier, _max_nan, _walsh, _zero_padding
from taco_accel.codec.gluon_kernels import _coalesced as _layouts
from taco_accel.codec.gluon_kernels import _swizzled as _ring_layout  # 8 lanes reading 8 rows: 8 bank groups

# triton 3.9's name, else 3.6's (the H200's)
_async_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _group_scales(y, G: gl.constexpr, QMAX: gl.constexpr, TINY: gl.constexpr):
    # per row of y: the scale s, the payload's multiplier and whether the group is bad
    return _scales_of(gl.reduce(gl.abs(y), 1, _max_nan), G, QMAX, TINY)


@gluon.jit
def _scales_of(amax, G: gl.constexpr, QMAX: gl.constexpr, TINY: gl.constexpr):
    # (s, multiplier, bad) of groups whose transformed (unnormalised) coefficients reach amax
    amax = amax * (G**-0.5)
    bad = (amax != amax) | (amax == float("inf"))
    big = amax >= TINY
    s = gl.where(bad, float("nan"), gl.where(big, gl.div_rn(amax, QMAX), 0.0))
    mult = gl.where(big & (~bad), gl.div_rn(QMAX, gl.where(big, amax, 1.0)), 0.0) * (G**-0.5)
    return s, mult, bad


@gluon.jit
def _encode_store(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                  TINY: gl.constexpr, PAD: gl.constexpr):
    # scales and payload of the transformed rows y [32 NW, G] (row layout): the committed kernels' formula
    ROWS: gl.constexpr = 32 * NW
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_Q: gl.constexpr = _layouts(G, NW, 1)
    s, mult, bad = _group_scales(y, G, QMAX, TINY)
    q = gl.convert_layout(gl.where(bad[:, None], 0.0, y * mult[:, None]).to(q_ptr.dtype.element_ty), L_Q)
    qrows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Q))
    qoffs = qrows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]
    gl.store(q_ptr + qoffs, q, mask=qrows[:, None] < gpc)
    srows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
    gl.store(s_ptr + gpc * (G // 4) + srows, s, mask=srows < gpc)
    _zero_padding(q_ptr, r0, gpc, chunk_bytes, NW, PAD)  # the chunk's unused last bytes


@gluon.jit
def compress_rows(x_ptr, q_ptr, s_ptr, numel, gpc, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                  TINY: gl.constexpr, X_BYTES: gl.constexpr, chunk_bytes, PAD: gl.constexpr):
    r0 = gl.program_id(0) * (32 * NW)
    y = _load_transform(x_ptr, r0, numel, G, NW, X_BYTES)
    _encode_store(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD)


@gluon.jit
def _load_transform(x_ptr, r0, numel, G: gl.constexpr, NW: gl.constexpr, X_BYTES: gl.constexpr):
    # rows r0.. of x (zeros past numel), transformed: fp32 [32 NW, G] in the row layout
    ROWS: gl.constexpr = 32 * NW
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_X: gl.constexpr = _layouts(G, NW, X_BYTES)
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_X))
    offs = rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_X))[None, :]
    x = gl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    return _walsh(gl.convert_layout(x, L_ROW).to(gl.float32), L_ROW, ROWS, G, 0)


@gluon.jit
def decompress_rows(q_ptr, s_ptr, out_ptr, numel, gpc, G: gl.constexpr, NW: gl.constexpr,
                    OUT_BYTES: gl.constexpr):
    ROWS: gl.constexpr = 32 * NW
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_OUT: gl.constexpr = _layouts(G, NW, OUT_BYTES)
    L_Q: gl.constexpr = _layouts(G, NW, 1)
    r0 = gl.program_id(0) * ROWS
    qrows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Q))
    qoffs = qrows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]
    q = gl.load(q_ptr + qoffs, mask=qrows[:, None] < gpc)
    srows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
    scale = gl.load(s_ptr + gpc * (G // 4) + srows, mask=srows < gpc, other=0.0) * (G**-0.5)
    y = _walsh(gl.convert_layout(q, L_ROW).to(gl.float32), L_ROW, ROWS, G, 0)
    x = gl.convert_layout((y * scale[:, None]).to(out_ptr.dtype.element_ty), L_OUT)
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_OUT))
    offs = rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_OUT))[None, :]
    gl.store(out_ptr + offs, x, mask=offs < numel)


# --- persistent: programs walk the tiles; the next STAGES - 1 tiles are copied to shared memory
# (cp.async) while one is transformed, and the transform reads its rows straight from there


@gluon.jit
def _issue(ring, slot, ptr, tile, tiles, numel, gpc, G: gl.constexpr, ROWS: gl.constexpr, L: gl.constexpr,
           ROW_MASK: gl.constexpr):
    rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
    offs = rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L))[None, :]
    if ROW_MASK:
        mask = (rows[:, None] < gpc) & (tile < tiles)
    else:
        mask = (offs < numel) & (tile < tiles)
    _async_copy(ring.index(slot), ptr + offs, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _refill(ring, k, ptr, tile, step, tiles, numel, gpc, G: gl.constexpr, ROWS: gl.constexpr, L: gl.constexpr,
            ROW_MASK: gl.constexpr, STAGES: gl.constexpr):
    # copy the tile STAGES - 1 steps ahead into the slot iteration k - 1 read
    _barrier()  # every lane has read the slot the next copy overwrites
    _issue(ring, (k + STAGES - 1) % STAGES, ptr, tile + (STAGES - 1) * step, tiles, numel, gpc, G, ROWS, L, ROW_MASK)


@gluon.jit
def _ring_start(ptr, numel, gpc, G: gl.constexpr, ROWS: gl.constexpr, L: gl.constexpr, ROW_MASK: gl.constexpr,
                STAGES: gl.constexpr, ELEM_BYTES: gl.constexpr):
    # the ring of this program's tiles (every num_programs-th), its first STAGES - 1 copies asked for
    ring = gl.allocate_shared_memory(ptr.dtype.element_ty, [STAGES, ROWS, G], _ring_layout(ELEM_BYTES))
    tiles = gl.cdiv(gpc, ROWS)
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    for i in gl.static_range(STAGES - 1):
        _issue(ring, i, ptr, pid + i * step, tiles, numel, gpc, G, ROWS, L, ROW_MASK)
    return ring, tiles, pid, step


@gluon.jit
def _landed(ring, k, STAGES: gl.constexpr):
    # this iteration's slot, once every lane's copies into it have landed
    async_copy.wait_group(STAGES - 1)
    _barrier()
    return ring.index(k % STAGES)


@gluon.jit
def compress_rows_ring(x_ptr, q_ptr, s_ptr, numel, gpc, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                       TINY: gl.constexpr, X_BYTES: gl.constexpr, chunk_bytes, PAD: gl.constexpr,
                       STAGES: gl.constexpr):
    ROWS: gl.constexpr = 32 * NW
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_X: gl.constexpr = _layouts(G, NW, X_BYTES)
    ring, tiles, pid, step = _ring_start(x_ptr, numel, gpc, G, ROWS, L_X, False, STAGES, X_BYTES)
    k = 0
    for tile in range(pid, tiles, step):
        _refill(ring, k, x_ptr, tile, step, tiles, numel, gpc, G, ROWS, L_X, False, STAGES)
        y = _walsh(_landed(ring, k, STAGES).load(L_ROW).to(gl.float32), L_ROW, ROWS, G, 0)
        _encode_store(y, tile * ROWS, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD)
        k += 1
    async_copy.wait_group(0)


@gluon.jit
def decompress_rows_ring(q_ptr, s_ptr, out_ptr, numel, gpc, G: gl.constexpr, NW: gl.constexpr,
                         OUT_BYTES: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = 32 * NW
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_OUT: gl.constexpr = _layouts(G, NW, OUT_BYTES)
    L_Q: gl.constexpr = _layouts(G, NW, 1)
    ring, tiles, pid, step = _ring_start(q_ptr, numel, gpc, G, ROWS, L_Q, True, STAGES, 1)
    k = 0
    for tile in range(pid, tiles, step):
        _refill(ring, k, q_ptr, tile, step, tiles, numel, gpc, G, ROWS, L_Q, True, STAGES)
        r0 = tile * ROWS
        srows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))
        scale = gl.load(s_ptr + gpc * (G // 4) + srows, mask=srows < gpc, other=0.0) * (G**-0.5)
        y = _walsh(_landed(ring, k, STAGES).load(L_ROW).to(gl.float32), L_ROW, ROWS, G, 0)
        x = gl.convert_layout((y * scale[:, None]).to(out_ptr.dtype.element_ty), L_OUT)
        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_OUT))
        offs = rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_OUT))[None, :]
        gl.store(out_ptr + offs, x, mask=offs < numel)
        k += 1
    async_copy.wait_group(0)
