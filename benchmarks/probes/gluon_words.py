"""Run 11 probe kernels (Gluon): the run 10 encoder (`gluon_rows.py`, one group per thread) with
fewer instructions per group, and two persistent forms, for compress at 16M values.

On sm_90 the run 10 encoder is 2032 instructions per group against the decoder's 1592. The flags:

- WORDS (`compress_words`): bf16 values travel as int32 words (two values each) through the load
  and the layout change, and each word becomes its two fp32 values with one shift and one mask.
  Loaded as bf16 they cost a PRMT to pack them for shared memory, a PRMT and a shift to unpack
  the upper one (about 275 instructions a group instead of 128). The two values of a word are
  the pair of the first butterfly stage.
- RARE_BAD: a group with NaN or Inf gets multiplier 0, and its payload (NaN where the
  coefficients are not finite) is overwritten with zeros under a branch the whole warp skips
  when none of its 32 groups is bad, instead of a select on every value (128 a group).
- SMEM: the tiles cross swizzled shared buffers of their own (16-byte stores and loads) instead
  of `convert_layout`'s scratch (4 rounds of stmatrix, each after 16 register moves).

Persistent: `compress_words_ring` copies the next tile to shared memory with cp.async while one
is encoded; `compress_words_prefetch` loads it into registers. Single chunk, single scale, no
signs, bf16 input: the default config, enough to time the ideas. The library's encoder
(`codec/gluon_kernels.py`) is WORDS + RARE_BAD + SMEM with every option of the codec.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from gluon_rows import _encode_store, _group_scales, _landed, _load_transform, _refill, _ring_start
from taco_accel.codec.gluon_kernels import _barrier, _through_shared, _walsh, _zero_padding
from taco_accel.codec.gluon_kernels import _coalesced as _layouts


@gluon.jit
def _words_transformed(w, L_ROW: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr):
    """Words [ROWS, G / 2] (row layout) -> the rows transformed, fp32 [ROWS, G] in L_ROW."""
    lo = (w << 16).to(gl.float32, bitcast=True)  # value 2k: the word's low half
    hi = (w & -65536).to(gl.float32, bitcast=True)  # value 2k + 1
    return _walsh(gl.reshape(gl.join(lo + hi, lo - hi), [ROWS, G]), L_ROW, ROWS, G, 1)  # stage 1: the pairs


@gluon.jit
def _encode_store_rare(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G: gl.constexpr, NW: gl.constexpr,
                       QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr, SMEM: gl.constexpr,
                       MASKED: gl.constexpr = True, t_ptr=None, LANES: gl.constexpr = 1, whole=None):
    """`gluon_rows._encode_store` with the bad groups' zeros written under a warp-uniform branch;
    SMEM: the payload crosses a swizzled shared buffer of its own; each row of y in LANES lanes;
    ``whole`` (run 13, MASKED): a runtime flag, true where every row is a group of the chunk (the
    payload's store without a mask)."""
    ROWS: gl.constexpr = 32 * NW // LANES
    L_Y: gl.constexpr = y.type.layout  # rows in LANES lanes; any order of a row's values over them
    L_Q: gl.constexpr = _layouts(G, NW, 1)
    s, mult, bad = _group_scales(y, G, QMAX, TINY)
    if t_ptr is not None:
        _stamp(t_ptr, s.to(gl.int32, bitcast=True), 2)  # the scales known: the transform done
    q = (y * mult[:, None]).to(q_ptr.dtype.element_ty)
    if SMEM:
        q = _through_shared(q, L_Q, 1)
    else:
        q = gl.convert_layout(q, L_Q)
    qrows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Q))
    qoffs = qrows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]
    if whole is not None:
        if whole:
            gl.store(q_ptr + qoffs, q)
        else:
            gl.store(q_ptr + qoffs, q, mask=qrows[:, None] < gpc)
    elif MASKED:
        gl.store(q_ptr + qoffs, q, mask=qrows[:, None] < gpc)
    else:
        gl.store(q_ptr + qoffs, q)
    if gl.max(bad.to(gl.int32), axis=0) > 0:  # rare: zeros over the payload of the bad groups
        bad_q = gl.convert_layout(bad, gl.SliceLayout(1, L_Q))
        zero = gl.zeros([ROWS, G], gl.float32, L_Q).to(q_ptr.dtype.element_ty)
        gl.store(q_ptr + qoffs, zero, mask=(bad_q & (qrows < gpc))[:, None])
    srows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_Y))
    gl.store(s_ptr + gpc * (G // 4) + srows, s, mask=srows < gpc)
    _zero_padding(q_ptr, r0, gpc, chunk_bytes, NW, PAD, LANES)  # the chunk's unused last bytes


@gluon.jit
def _encode(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
            TINY: gl.constexpr, PAD: gl.constexpr, RARE_BAD: gl.constexpr, SMEM: gl.constexpr,
            MASKED: gl.constexpr = True, t_ptr=None):
    if RARE_BAD:
        _encode_store_rare(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD, SMEM, MASKED, t_ptr)
    else:
        _encode_store(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD)


@gluon.jit
def compress_words(w_ptr, q_ptr, s_ptr, nwords, gpc, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                   TINY: gl.constexpr, chunk_bytes, PAD: gl.constexpr, RARE_BAD: gl.constexpr,
                   SMEM: gl.constexpr, MASKED: gl.constexpr = True, EVICT: gl.constexpr = "",
                   HADAMARD: gl.constexpr = True, t_ptr=None, STAGGER: gl.constexpr = 0, sms=1, ahead=0,
                   PREFETCH: gl.constexpr = False):
    """bf16 values read as int32 words (w_ptr: the input viewed as int32; even numel). SMEM: the
    tile crosses a swizzled shared buffer of its own (16-byte stores and loads) instead of
    `convert_layout`'s scratch (4 rounds of stmatrix, each after 16 register moves). Run 12:
    MASKED=False drops the bounds masks (whole tiles only), EVICT is the input loads' eviction
    policy, t_ptr (int64 [programs, 5]) takes each program's `_stamp`s, STAGGER > 0 makes the
    programs of the first wave (the first ``sms`` * 12) wait their round in it times STAGGER ns,
    PREFETCH: each program asks the L2 for the tile of the program ``ahead`` places later."""
    ROWS: gl.constexpr = 32 * NW
    W: gl.constexpr = G // 2
    L_ROWW: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [NW, 1], [1, 0])
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_XW: gl.constexpr = _layouts(W, NW, 4)
    r0 = gl.program_id(0) * ROWS
    one = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))  # a value per thread
    if t_ptr is not None:
        _stamp(t_ptr, one, 0)
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_XW))
    k = rows[:, None] * W + gl.arange(0, W, layout=gl.SliceLayout(0, L_XW))[None, :]
    if STAGGER > 0:
        nwords = _after_sleep(nwords, gl.program_id(0), sms, STAGGER, one)
    if MASKED:
        w = gl.load(w_ptr + k, mask=k < nwords, other=0, eviction_policy=EVICT)
    else:
        w = gl.load(w_ptr + k, eviction_policy=EVICT)
    if PREFETCH:
        _prefetch_tile(w_ptr, gl.program_id(0) + ahead, nwords // (ROWS * W), ROWS * W, one)
    if SMEM:
        w = _through_shared(w, L_ROWW, 4)
    else:
        w = gl.convert_layout(w, L_ROWW)
    if t_ptr is not None:
        _stamp(t_ptr, gl.convert_layout(_first_column(w, ROWS, W), gl.SliceLayout(1, L_ROW)), 1)  # the tile arrived
    if HADAMARD:
        y = _words_transformed(w, L_ROW, ROWS, G)
    else:
        lo = (w << 16).to(gl.float32, bitcast=True)
        hi = (w & -65536).to(gl.float32, bitcast=True)
        y = gl.convert_layout(gl.reshape(gl.join(lo, hi), [ROWS, G]), L_ROW)
    _encode(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD, RARE_BAD, SMEM, MASKED, t_ptr)
    if t_ptr is not None:
        _stamp(t_ptr, one, 3)
        _stamp_sm(t_ptr, one)


def words_operands(x, buf, lay) -> tuple[tuple, dict]:
    """What every run 11-12 words encoder takes for bf16 ``x`` into ``buf`` (single chunk, e4m3,
    G = 128): the input as int32 words, the payload and scales, words, groups; and by name G,
    QMAX, TINY, chunk_bytes, PAD."""
    from taco_accel.codec.reference import TINY_AMAX

    return ((x.view(torch.int32), buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.numel // 2,
             lay.groups_per_chunk),
            dict(G=128, QMAX=448.0, TINY=TINY_AMAX, chunk_bytes=lay.chunk_bytes, PAD=lay.chunk_bytes - lay.used_bytes))


def words_launcher(**flags):
    """`compress_words` (rare bad groups, smem crossings) with ``flags`` as a variant
    ``fn(x, buf, layout, t=None)`` of bf16 input, single chunk, e4m3, G = 128."""
    def run(x, buf, lay, t=None):
        args, named = words_operands(x, buf, lay)
        compress_words[(triton.cdiv(lay.groups_per_chunk, 32),)](
            *args, **named, NW=1, RARE_BAD=True, SMEM=True, t_ptr=t,
            sms=torch.cuda.get_device_properties(x.device).multi_processor_count, num_warps=1, **flags)
    return run


def prefetch_launcher(waves: float):
    """`compress_words` whose programs prefetch the tile ``waves`` waves (SMs * 12 programs) ahead."""
    def run(x, buf, lay, t=None):
        ahead = int(waves * 12 * torch.cuda.get_device_properties(x.device).multi_processor_count)
        words_launcher(PREFETCH=True, ahead=ahead)(x, buf, lay, t)
    return run


@gluon.constexpr_function
def _bulk_prefetch(nbytes):
    return ("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], " + str(nbytes)
            + "; mov.u32 $0, 0; }")


@gluon.jit
def _prefetch_tile(ptr, tile, tiles, TILE: gl.constexpr, one_per_thread):
    """One lane asks the L2 for ``TILE`` elements of ``ptr`` from tile ``tile`` on (a bulk
    prefetch: nothing waits for it), if ``tile`` < ``tiles`` (whole tiles inside the tensor)."""
    lane = gl.arange(0, one_per_thread.shape[0], layout=one_per_thread.type.layout)
    first = (ptr + tile.to(gl.int64) * TILE + lane * 0).to(gl.int64, bitcast=True)
    go = ((lane == 0) & (tile < tiles)).to(gl.int32)
    gl.inline_asm_elementwise(_bulk_prefetch(TILE * ptr.dtype.element_ty.primitive_bitwidth // 8), "=r,l,r",
                              [first, go], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _after_sleep(limit, pid, sms, STAGGER: gl.constexpr, like):
    """``limit`` once this program has slept (pid // sms) * STAGGER ns, if it is in the first 12
    rounds (each thread once: ``like`` holds one value per thread): a clock read after the sleep,
    or-ed into a value no smaller than ``limit``, that no compiler can fold, so the loads masked
    by it wait."""
    ns = gl.where(pid < 12 * sms, pid // sms, 0) * STAGGER + gl.zeros_like(like)
    t = gl.inline_asm_elementwise("{ nanosleep.u32 $1; mov.u32 $0, %clock; }", "=r,r", [ns], dtype=gl.int32,
                                  is_pure=False, pack=1)
    lim = gl.min(gl.minimum(limit.to(gl.uint32), (t | 0x7FFFFFFF).to(gl.uint32, bitcast=True)), axis=0).to(gl.int32)
    return (lim // 16) * 16  # a multiple of 16, as the launcher promises for ``limit``: 16-byte loads


@gluon.jit
def _first_column(w, ROWS: gl.constexpr, W: gl.constexpr):
    """w[:, 0] of a row-per-thread tile, by splits (register renaming, no instructions)."""
    for i in gl.static_range(W.bit_length() - 1):
        w, _ = gl.split(gl.reshape(w, [ROWS, W >> (i + 1), 2]))
    return gl.reshape(w, [ROWS])


@gluon.jit
def _stamp_store(t_ptr, v, slot: gl.constexpr):
    lane = gl.arange(0, v.shape[0], layout=v.type.layout)
    gl.store(t_ptr + gl.program_id(0) * 5 + slot + lane * 0, v, mask=lane == 0)


@gluon.jit
def _stamp_sm(t_ptr, one_per_thread):
    """This program's SM into its slot 4."""
    smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [one_per_thread], dtype=gl.int32, is_pure=False,
                                     pack=1)
    _stamp_store(t_ptr, smid.to(gl.int64), 4)


@gluon.jit
def _stamp(t_ptr, after, slot: gl.constexpr):
    """%globaltimer (ns) into this program's ``slot``, read once ``after`` (int32, one per thread)
    is known: the PTX predicates the read on it (in the sm_90 SASS each read sits after the
    instructions that made its input)."""
    t = gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, 2139095041; mov.u64 $0, 0; @p mov.u64 $0, %globaltimer; }",
        "=l,r", [after], dtype=gl.int64, is_pure=False, pack=1)
    _stamp_store(t_ptr, t, slot)


@gluon.jit
def compress_rows_rare(x_ptr, q_ptr, s_ptr, numel, gpc, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                       TINY: gl.constexpr, X_BYTES: gl.constexpr, chunk_bytes, PAD: gl.constexpr):
    """`gluon_rows.compress_rows` (values loaded as bf16) with RARE_BAD only."""
    r0 = gl.program_id(0) * (32 * NW)
    y = _load_transform(x_ptr, r0, numel, G, NW, X_BYTES)
    _encode_store_rare(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD, False)


@gluon.jit
def compress_words_ring(w_ptr, q_ptr, s_ptr, nwords, gpc, G: gl.constexpr, NW: gl.constexpr, QMAX: gl.constexpr,
                        TINY: gl.constexpr, chunk_bytes, PAD: gl.constexpr, STAGES: gl.constexpr,
                        RARE_BAD: gl.constexpr, SMEM: gl.constexpr):
    """Persistent: the next STAGES - 1 tiles' words copied to shared memory (cp.async) while one is
    encoded (`gluon_rows.compress_rows_ring` with words)."""
    ROWS: gl.constexpr = 32 * NW
    W: gl.constexpr = G // 2
    L_ROWW: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [NW, 1], [1, 0])
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_XW: gl.constexpr = _layouts(W, NW, 4)
    ring, tiles, pid, step = _ring_start(w_ptr, nwords, gpc, W, ROWS, L_XW, False, STAGES, 4)  # rows of W words
    k = 0
    for tile in range(pid, tiles, step):
        _refill(ring, k, w_ptr, tile, step, tiles, nwords, gpc, W, ROWS, L_XW, False, STAGES)
        y = _words_transformed(_landed(ring, k, STAGES).load(L_ROWW), L_ROW, ROWS, G)
        _encode(y, tile * ROWS, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD,
                RARE_BAD, SMEM)
        k += 1
    async_copy.wait_group(0)


@gluon.jit
def compress_words_prefetch(w_ptr, q_ptr, s_ptr, nwords, gpc, G: gl.constexpr, NW: gl.constexpr,
                            QMAX: gl.constexpr, TINY: gl.constexpr, chunk_bytes, PAD: gl.constexpr):
    """Persistent: each program loads its next tile's words into registers before it encodes this
    one, so that its loads stay in flight while it computes (no shared-memory ring, no cp.async)."""
    ROWS: gl.constexpr = 32 * NW
    W: gl.constexpr = G // 2
    L_ROWW: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [NW, 1], [1, 0])
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    L_XW: gl.constexpr = _layouts(W, NW, 4)
    tiles = gl.cdiv(gpc, ROWS)
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_XW))
    k = rows[:, None] * W + gl.arange(0, W, layout=gl.SliceLayout(0, L_XW))[None, :]
    w = gl.load(w_ptr + k, mask=k < nwords, other=0)
    for tile in range(pid, tiles, step):
        k = k + step * (ROWS * W)
        w_next = gl.load(w_ptr + k, mask=k < nwords, other=0)
        y = _words_transformed(gl.convert_layout(w, L_ROWW), L_ROW, ROWS, G)
        _encode_store_rare(y, tile * ROWS, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX,
                           TINY, PAD, False)
        w = w_next


# --- persistent with bulk (TMA) copies: one lane asks for the next tiles, no per-lane addresses

from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # triton 3.9, else 3.6


@gluon.jit
def _tma_issue(w_desc, ring, bars, slot, tile, tiles, ROWS: gl.constexpr):
    # the tile's two 128-byte halves of each row (a 128-byte swizzle holds rows of 128 bytes at most)
    ok = tile < tiles
    mbarrier.expect(bars.index(slot), 2 * w_desc.block_type.nbytes, pred=ok)
    _tma_load(w_desc, [tile * ROWS, 0], bars.index(slot), ring.index(2 * slot), pred=ok)
    _tma_load(w_desc, [tile * ROWS, 32], bars.index(slot), ring.index(2 * slot + 1), pred=ok)


@gluon.jit
def compress_words_tma(w_desc, q_ptr, s_ptr, gpc, G: gl.constexpr, QMAX: gl.constexpr, TINY: gl.constexpr,
                       chunk_bytes, PAD: gl.constexpr, STAGES: gl.constexpr):
    """Persistent, one warp: STAGES tiles in flight as bulk copies of the words ([32, 32] boxes of
    the input viewed as [groups, G / 2] int32, zeros past its end), each lane reading its row from
    the swizzled ring. G = 128, even numel, whole groups."""
    ROWS: gl.constexpr = 32
    L_HALF: gl.constexpr = gl.BlockedLayout([1, 32], [32, 1], [1, 1], [1, 0])
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [1, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [2 * STAGES, ROWS, 32], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    tiles = gl.cdiv(gpc, ROWS)
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    for i in gl.static_range(STAGES):
        _tma_issue(w_desc, ring, bars, i, pid + i * step, tiles, ROWS)
    k = 0
    for tile in range(pid, tiles, step):
        slot = k % STAGES
        mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
        lo = ring.index(2 * slot).load(L_HALF)
        hi = ring.index(2 * slot + 1).load(L_HALF)
        _barrier()  # every lane has read the slot: refill it
        _tma_issue(w_desc, ring, bars, slot, tile + STAGES * step, tiles, ROWS)
        w = gl.reshape(gl.permute(gl.join(lo, hi), [0, 2, 1]), [ROWS, G // 2])
        y = _words_transformed(w, L_ROW, ROWS, G)
        _encode_store_rare(y, tile * ROWS, q_ptr, s_ptr, gpc, chunk_bytes, G, 1, QMAX,
                           TINY, PAD, True)
        k += 1
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
