"""Run 12 probe kernels (Gluon): compress with a group split over TPG lanes of a warp.

`run12_tail.py` found that at 16M values compress loses to its own no-transform run at the
kernel's end: when the last tiles arrive, each warp still has its 1784 instructions to issue
at one a cycle (0.9 us), with little memory traffic left to hide them. Splitting a group over
TPG lanes divides each warp's instructions (and registers) by about TPG, for TPG times as many
warps: log2(G / TPG) stages inside each lane, then log2(TPG) stages between lanes (a butterfly
shuffle and an fma per value: `gluon_kernels._walsh` with LANES, which the library took over
for TPG = 2 up to 24M values).

bf16 read as int32 words, single chunk, single scale, e4m3: the default config. Beyond the
library's kernel: `compress_hybrid` (split programs first and / or last, whole-group programs
between), %globaltimer stamps (t_ptr), bulk L2 prefetches of a later program's tile (ahead),
no bounds masks (MASKED=False: whole tiles only) and the input loads' eviction policy (EVICT).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gluon_words import _encode_store_rare, _prefetch_tile, _stamp, _stamp_sm, words_operands
from taco_accel.codec.gluon_kernels import _coalesced, _through_shared, _walsh


@gluon.jit
def _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, r0, G: gl.constexpr, TPG: gl.constexpr,
                 QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr, NW: gl.constexpr = 1, t_ptr=None,
                 ahead=0, PREFETCH: gl.constexpr = False, MASKED: gl.constexpr = True, EVICT: gl.constexpr = ""):
    """NW warps encode groups r0 .. r0 + 32 * NW / TPG, TPG lanes each (bf16 as words, w_ptr
    int32). TPG = NW = 1 compiles to the library encoder's sm_90 code for this config (1784
    instructions)."""
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
    if MASKED:
        w = gl.load(w_ptr + k, mask=k < nwords, other=0, eviction_policy=EVICT)
    else:  # whole tiles only
        w = gl.load(w_ptr + k, eviction_policy=EVICT)
    if PREFETCH:  # the tile ``ahead`` programs later
        _prefetch_tile(w_ptr, r0 // ROWS + ahead, nwords // (ROWS * W), ROWS * W, one)
    w = _through_shared(w, L_V, 4)
    lo = (w << 16).to(gl.float32, bitcast=True)  # value 2k
    hi = (w & -65536).to(gl.float32, bitcast=True)  # value 2k + 1
    y = _walsh(gl.reshape(gl.join(lo + hi, lo - hi), [ROWS, G]), L_ROW, ROWS, G, 1, TPG)  # stage 1, then the rest

    _encode_store_rare(y, r0, q_ptr, s_ptr, gpc, chunk_bytes, G, NW, QMAX, TINY, PAD, True, MASKED, t_ptr, TPG)
    if t_ptr is not None:
        _stamp(t_ptr, one, 3)
        _stamp_sm(t_ptr, one)


@gluon.jit
def compress_split(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, G: gl.constexpr, TPG: gl.constexpr,
                   QMAX: gl.constexpr, TINY: gl.constexpr, PAD: gl.constexpr, NW: gl.constexpr, t_ptr=None,
                   ahead=0, PREFETCH: gl.constexpr = False, MASKED: gl.constexpr = True, EVICT: gl.constexpr = ""):
    """Every program: NW warps, 32 * NW / TPG groups; t_ptr: `gluon_words._stamp`s (slot 1 unused)."""
    _encode_tile(w_ptr, q_ptr, s_ptr, nwords, gpc, chunk_bytes, gl.program_id(0) * (32 * NW // TPG), G, TPG, QMAX,
                 TINY, PAD, NW, t_ptr, ahead, PREFETCH, MASKED, EVICT)


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


def split_launcher(tpg: int, nw: int = 1, ahead_waves: float = 0, slots_per_sm: int = 25, **options):
    """`compress_split` as a variant ``fn(x, buf, layout, t=None)``: bf16 x, single chunk, e4m3, G = 128;
    ``ahead_waves`` > 0: each program prefetches the tile that many waves (SMs * ``slots_per_sm``
    programs) later."""
    def run(x, buf, lay, t=None):
        ahead = int(ahead_waves * slots_per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
        args, named = words_operands(x, buf, lay)
        compress_split[(triton.cdiv(lay.groups_per_chunk, 32 * nw // tpg),)](
            *args, **named, TPG=tpg, NW=nw, t_ptr=t, ahead=ahead, PREFETCH=ahead > 0, num_warps=nw, **options)
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
