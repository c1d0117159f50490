"""Run 12 probe kernels (Gluon): compress with a group split over TPG lanes of a warp.

`run12_tail.py` found that at 16M values compress loses to its own no-transform run at the
kernel's end: when the last tiles arrive, each warp still has its 1784 instructions to issue
at one a cycle (0.9 us), with little memory traffic left to hide them. Splitting a group over
TPG lanes divides each warp's instructions (and registers) by about TPG, for TPG times as many
warps: log2(G / TPG) stages inside each lane, then log2(TPG) stages between lanes (a butterfly
shuffle and an fma per value: `gluon_kernels._walsh` with LANES, which the library took over
for TPG = 2 up to 24M values, and in run 13 with 4-lane programs first and last: its split
schedule, up to 48M values).

bf16 read as int32 words, single chunk, single scale, e4m3: the default config. Beyond the
library's kernel: `compress_hybrid` (split programs first and / or last, whole-group programs
between), %globaltimer stamps (t_ptr), bulk L2 prefetches of a later program's tile (ahead),
no bounds masks (MASKED=False: whole tiles only) and the input loads' eviction policy (EVICT);
run 13: the last two stages in fewer instructions (TRIM, `_pair_walsh`), masks skipped by a
branch on whole tiles (WHOLE), 4-lane programs first and last around a 2-lane body without
masks (TAIL, head; the library's `split_schedule`).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gluon_words import _encode_store_rare, _prefetch_tile, _stamp, _stamp_sm, words_operands
from taco_accel.codec.gluon_kernels import _butterfly_shuffle, _coalesced, _stage, _through_shared, _walsh


@gluon.jit
def _pair_walsh(y, ROWS: gl.constexpr, G: gl.constexpr, FIRST: gl.constexpr):
    """Run 13: `_walsh` of rows y [ROWS, G] in 2 lanes (G / 2 consecutive values each) with the
    last two stages (strides G / 4 and G / 2) in 96 instructions a lane instead of 128: 32
    shuffles, 64 fmas with a per-lane sign s (1 in the row's first lane, -1 in its second). The
    stride-G/4 stage leaves the second lane with its sums in its upper half and its differences,
    negated, in the lower (b - a: one rounding, as a - b), so that both lanes send their upper
    halves. Result [ROWS, G] in the reference's order: the first lane holds values k and G/2 + k,
    the second G/4 + k and 3G/4 + k (k < G/4). Equal to the reference but where a coefficient of
    0 takes a sign the reference's would not have (a - b = +0 for a = b, negated: +0, not -0)."""
    for i in gl.static_range(FIRST, (G // 4).bit_length() - 1):  # strides up to G / 8, in each lane
        y = _stage(y, ROWS, G, 1 << i)
    a, b = gl.split(gl.permute(gl.reshape(y, [ROWS, 2, 2, G // 4]), [0, 1, 3, 2]))  # [ROWS, lane, k]: k, G/4 + k
    L3: gl.constexpr = a.type.layout
    s = (1 - 2 * gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))).to(gl.float32)[None, :, None]
    low = gl.fma(a, s, b)  # a + b; second lane: b - a
    up = gl.fma(b, -s, a)  # a - b; second lane: a + b
    p = gl.inline_asm_elementwise(_butterfly_shuffle(1), "=f,f", [up], dtype=gl.float32, is_pure=True, pack=1)
    total = gl.fma(low, s, p)  # first lane: own + partner's; second: partner's - own negated difference
    diff = gl.fma(p, -s, low)
    return gl.reshape(gl.permute(gl.join(total, diff), [0, 3, 1, 2]), [ROWS, G])  # [ROWS, part, lane, k]


@gluon.jit
def _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, r0, G: gl.constexpr, TPG: gl.constexpr,
                 QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr, NW: gl.constexpr = 1, t_ptr=None,
                 ahead=0, PREFETCH: gl.constexpr = False, MASKED: gl.constexpr = True, EVICT: gl.constexpr = "",
                 TRIM: gl.constexpr = False, WHOLE: gl.constexpr = False):
    """NW warps encode groups r0 .. r0 + 32 * NW / TPG, TPG lanes each (bf16 as words, w_ptr
    int32). TPG = NW = 1 compiles to the library encoder's sm_90 code for this config (1784
    instructions). Run 13: TRIM (TPG = 2): the last two stages by `_pair_walsh`; WHOLE (MASKED):
    the payload's load and store without masks in a tile of the input's whole groups (a branch
    around each)."""
    ROWS: gl.constexpr = 32 * NW // TPG
    W: gl.constexpr = G // 2
    L_ROW: gl.constexpr = gl.BlockedLayout([1, G // TPG], [32 // TPG, TPG], [NW, 1], [1, 0])
    L_V: gl.constexpr = gl.BlockedLayout([1, W // TPG], [32 // TPG, TPG], [NW, 1], [1, 0])
    L_X: gl.constexpr = _coalesced(W, NW, 4)
    one = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_ROW))  # a value per thread
    if t_ptr is not None:
        _stamp(t_ptr, one, 0)
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_X))
    k = rows[:, None] * W + gl.arange(0, W, layout=gl.SliceLayout(0, L_X))[None, :]
    whole = None
    if WHOLE:
        whole = (r0 + ROWS) * W <= nwords
    if whole is not None:
        if whole:
            w = gl.load(w_ptr + k, eviction_policy=EVICT)
        else:
            w = gl.load(w_ptr + k, mask=k < nwords, other=0, eviction_policy=EVICT)
    elif MASKED:
        w = gl.load(w_ptr + k, mask=k < nwords, other=0, eviction_policy=EVICT)
    else:  # whole tiles only
        w = gl.load(w_ptr + k, eviction_policy=EVICT)
    if PREFETCH:  # the tile ``ahead`` programs later
        _prefetch_tile(w_ptr, r0 // ROWS + ahead, nwords // (ROWS * W), ROWS * W, one)
    w = _through_shared(w, L_V, 4)
    lo = (w << 16).to(gl.float32, bitcast=True)  # value 2k
    hi = (w & -65536).to(gl.float32, bitcast=True)  # value 2k + 1
    y = gl.reshape(gl.join(lo + hi, lo - hi), [ROWS, G])  # stage 1
    if TRIM:
        y = _pair_walsh(y, ROWS, G, 1)
    else:
        y = _walsh(y, L_ROW, ROWS, G, 1, TPG)

    _encode_store_rare(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD, True, MASKED, t_ptr, TPG, whole)
    if t_ptr is not None:
        _stamp(t_ptr, one, 3)
        _stamp_sm(t_ptr, one)


@gluon.jit
def compress_split(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, G: gl.constexpr, TPG: gl.constexpr,
                   QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr, NW: gl.constexpr, t_ptr=None,
                   ahead=0, PREFETCH: gl.constexpr = False, MASKED: gl.constexpr = True, EVICT: gl.constexpr = "",
                   TRIM: gl.constexpr = False, WHOLE: gl.constexpr = False, TAIL: gl.constexpr = False, tail=0, head=0):
    """Every program: NW warps, 32 * NW / TPG groups; t_ptr: `gluon_words._stamp`s (slot 1 unused).
    Run 13: TRIM and WHOLE as in `_encode_tile`; TAIL (TPG = 2): the groups from ``tail`` on go 8
    a program over 4 lanes, whose warps issue 712 instructions instead of 1096 when the kernel's
    last tiles land, and so do the first ``head`` / 2 groups (programs r0 < head)."""
    ROWS: gl.constexpr = 32 * NW // TPG
    r0 = gl.program_id(0) * ROWS
    if TAIL:
        if r0 < head:  # the first programs: 8 groups over 4 lanes, as the tail's
            _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, r0 // 2, G, 4, QMAX, TINY, PAD, NW, t_ptr,
                         ahead, PREFETCH, False, EVICT)
        elif r0 >= tail:
            _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, tail - head // 2 + (r0 - tail) // 2, G, 4,
                         QMAX, TINY, PAD, NW, t_ptr, ahead, PREFETCH, True, EVICT)
        else:
            _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, r0 - head // 2, G, TPG, QMAX, TINY, PAD, NW,
                         t_ptr, ahead, PREFETCH, False, EVICT, TRIM)  # before the tail: whole tiles
    else:
        _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, r0, G, TPG, QMAX, TINY, PAD, NW, t_ptr, ahead,
                     PREFETCH, MASKED, EVICT, TRIM, WHOLE)


@gluon.jit
def compress_hybrid(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, head, body, G: gl.constexpr,
                    QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr):
    """Programs 0 .. head - 1 and from head + body on: 16 groups over 2 lanes each; the body's
    programs: 32 groups, one a lane. The grid hands out programs in order, so the first and the
    last to run are the split ones, whose warps finish in about 960 instead of 1650 issues."""
    pid = gl.program_id(0)
    if pid < head:
        _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, pid * 16, G, 2, QMAX, TINY, PAD)
    elif pid < head + body:
        _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, head * 16 + (pid - head) * 32, G, 1, QMAX,
                     TINY, PAD)
    else:
        _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, head * 16 + body * 32 + (pid - head - body) * 16,
                     G, 2, QMAX, TINY, PAD)


def split_launcher(tpg: int, nw: int = 1, ahead_waves: float = 0, slots_per_sm: int = 25, tail_waves: float = 0,
                   head_waves: float = 0, **options):
    """`compress_split` as a variant ``fn(x, buf, layout, t=None)``: bf16 x, single chunk, e4m3, G = 128;
    ``ahead_waves`` > 0: each program prefetches the tile that many waves (SMs * ``slots_per_sm``
    programs) later; ``tail_waves`` > 0 (tpg = 2): the last that many waves of programs code 8
    groups over 4 lanes (TAIL), and the first ``head_waves``."""
    def run(x, buf, lay, t=None):
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        ahead = int(ahead_waves * slots_per_sm * sms)
        args, named = words_operands(x, buf, lay)
        groups = lay.groups_per_chunk
        programs, extra = triton.cdiv(groups, 32 * nw // tpg), {}
        if tail_waves:  # groups [0, h): 4 lanes, [h, h + body): 2 lanes, whole tiles, the rest 4 lanes
            h = min(int(head_waves * slots_per_sm * sms) * 8, groups) // 16 * 16
            body = max(0, groups - h - int(tail_waves * slots_per_sm * sms) * 8) // 16 * 16
            programs = h // 8 + body // 16 + triton.cdiv(groups - h - body, 8)
            extra = dict(TAIL=True, tail=2 * h + body, head=2 * h)
        compress_split[(programs,)](*args, **named, TPG=tpg, NW=nw, t_ptr=t, ahead=ahead, PREFETCH=ahead > 0,
                                    num_warps=nw, **extra, **options)
    return run


def hybrid_launcher(head_waves: float, tail_waves: float, slots_per_sm: int = 12):
    """`compress_hybrid` as a variant: ``head_waves`` / ``tail_waves`` waves of split programs
    (SMs * ``slots_per_sm`` programs each) first and last, whole tiles between."""
    def run(x, buf, lay):
        wave = torch.cuda.get_device_properties(x.device).multi_processor_count * slots_per_sm
        groups = lay.groups_per_chunk
        head = min(int(head_waves * wave), groups // 16)
        tail = int(tail_waves * wave)
        body = max(0, (groups - head * 16 - tail * 16) // 32)
        programs = head + body + triton.cdiv(groups - head * 16 - body * 32, 16)
        args, named = words_operands(x, buf, lay)
        compress_hybrid[(programs,)](*args, **named, head=head, body=body, num_warps=1)
    return run
