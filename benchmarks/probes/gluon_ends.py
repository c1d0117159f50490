"""Run 14 probe kernel: the library's split encoder with its 4-lane programs only at the kernel's
ends in a chunked layout (the two-shot all-reduce's `compress(x, chunks=P)`).

The library's `split_schedule` gives every chunk its 1 / P share of the head and tail waves, and
the grid runs chunk after chunk, so for P > 1 most 4-lane programs run mid-kernel, where their
extra instructions a group (89 warp instructions against 68.5 over 2 lanes) buy nothing. Here
chunk 0 alone has the head and the last chunk alone the tail; the chunks between code all their
whole groups over 2 lanes, the rest (under 16 groups, or the input's end) over 4 lanes with
masks. The head is read without masks, as run 13's probe did (0.848 at 16M against the library's
0.843, in different calls): with one chunk that is all that differs from the library.

`compress_ends` has `gluon_kernels._compress_rows_kernel`'s signature and `ends_schedule`
`split_schedule`'s, so a probe times them through `compress_rows_into` with both swapped in
(`_probe.with_setting(vars(gluon_kernels), ...)`).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from taco_accel.codec import gluon_kernels as gk
from taco_accel.codec.gluon_kernels import _encode_rows, _tile_origin, whole_groups
from taco_accel.codec.layout import WireLayout


def _chunk_programs(gpc, head, body):
    """Programs of a chunk: ``head`` groups 8 a program, ``body`` 16, the rest 8."""
    return head // 8 + body // 16 + (gpc - head - body + 7) // 8


_programs = gluon.jit(_chunk_programs)  # the same count in the kernel


def ends_schedule(layout: WireLayout, sms: int) -> tuple[int, int, int]:
    """(chunk 0's head, the last chunk's body, programs a grid row) for `compress_ends`: a wave
    is SMs * SPLIT_WARPS_PER_SM programs of the whole kernel (not a chunk's share). The grid
    (programs, chunks) holds the chunks' programs one after another (fewer than ``chunks`` to
    spare), since chunk 0 and the last one need more than the others; the kernel works their
    counts out from head, body and gpc."""
    gpc, chunks = layout.groups_per_chunk, layout.chunks
    if chunks > 1 and whole_groups(layout, chunks - 2) < gpc:
        raise ValueError(f"compress_ends needs whole chunks but the last: {layout}")
    wave = sms * gk.SPLIT_WARPS_PER_SM * 8
    head = min(int(gk.SPLIT_HEAD_WAVES * wave), whole_groups(layout, 0)) // 16 * 16
    last_head = head if chunks == 1 else 0
    body = max(0, min(gpc - int(gk.SPLIT_TAIL_WAVES * wave), whole_groups(layout, chunks - 1)) - last_head) // 16 * 16
    total = _chunk_programs(gpc, last_head, body)
    if chunks > 1:
        total += (_chunk_programs(gpc, head, (gpc - head) // 16 * 16)
                  + (chunks - 2) * _chunk_programs(gpc, 0, gpc // 16 * 16))
    return head, body, max(1, triton.cdiv(total, chunks))


@gluon.jit
def compress_ends(
    x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, head, body,
    G: gl.constexpr, NW: gl.constexpr, X_BYTES: gl.constexpr, WORDS: gl.constexpr, FMT: gl.constexpr,
    QMAX: gl.constexpr, HADAMARD: gl.constexpr, SIGNS: gl.constexpr, DUAL: gl.constexpr,
    ADAPTIVE: gl.constexpr, ZERO_NONFINITE: gl.constexpr, CHUNKED: gl.constexpr, WIDE: gl.constexpr,
    PAD: gl.constexpr, SPLIT: gl.constexpr,
):
    """SPLIT only. Program L (grid row after grid row) codes in chunk c: the first ``head``
    groups (c = 0) 8 a program over 4 lanes without masks, then whole groups 16 a program over 2
    lanes without (the last chunk: ``body`` of them, which leaves the tail; the others: all but
    gpc % 16), the rest 8 a program over 4 lanes with masks."""
    gl.static_assert(SPLIT, "compress_ends codes split groups only")
    row, p = _tile_origin(1, WIDE)
    chunks = gl.num_programs(1)
    L = row * gl.num_programs(0) + p
    if chunks > 1:
        first_programs = _programs(gpc, head, (gpc - head) // 16 * 16)
        middle_programs = _programs(gpc, 0, gpc // 16 * 16)
        c = gl.where(L < first_programs, 0, gl.minimum(1 + (L - first_programs) // middle_programs, chunks - 1))
        p = gl.where(c == 0, L, L - first_programs - (c - 1) * middle_programs)
    else:
        c = row
        p = L
    last = c == chunks - 1
    h = gl.where(c == 0, head, 0)
    b = gl.where(last, body, (gpc - h) // 16 * 16)
    if (~last) | (p < _programs(gpc, h, b)):
        first = h // 8  # the body's first program
        if p < first:  # the head: whole groups, no masks (the library masks it, to keep two codes)
            _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, p * 8, G, NW, X_BYTES, WORDS,
                         FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED, PAD, 4, False)
        elif p < first + b // 16:
            _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, h + (p - first) * 16, G, NW,
                         X_BYTES, WORDS, FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED, PAD, 2,
                         False)
        else:
            _encode_rows(x_ptr, q_ptr, s_ptr, sign_ptr, numel, gpc, chunk_bytes, c, h + b + (p - first - b // 16) * 8,
                         G, NW, X_BYTES, WORDS, FMT, QMAX, HADAMARD, SIGNS, DUAL, ADAPTIVE, ZERO_NONFINITE, CHUNKED,
                         PAD, 4, True)


def program_groups(layout: WireLayout, head: int, body: int, programs: int):
    """(chunk, groups, masked) of each program of `compress_ends`'s grid, its arithmetic in Python."""
    gpc, chunks = layout.groups_per_chunk, layout.chunks
    for L in range(programs * chunks):
        c, p = 0, L
        if chunks > 1:
            first_programs = _chunk_programs(gpc, head, (gpc - head) // 16 * 16)
            middle_programs = _chunk_programs(gpc, 0, gpc // 16 * 16)
            c = 0 if L < first_programs else min(1 + (L - first_programs) // middle_programs, chunks - 1)
            p = L if c == 0 else L - first_programs - (c - 1) * middle_programs
        last = c == chunks - 1
        h = head if c == 0 else 0
        b = body if last else (gpc - h) // 16 * 16
        if last and p >= _chunk_programs(gpc, h, b):
            continue
        if p < h // 8:
            yield c, range(p * 8, p * 8 + 8), False
        elif p < h // 8 + b // 16:
            r0 = h + (p - h // 8) * 16
            yield c, range(r0, r0 + 16), False
        else:
            r0 = h + b + (p - h // 8 - b // 16) * 8
            yield c, range(r0, min(r0 + 8, gpc)), True


if __name__ == "__main__":  # the mapping's check, on the CPU: every group once, whole groups where unmasked
    from taco_accel.codec import TacoConfig

    layouts = [(1, 1), (127, 1), (128 * 16, 1), (128 * 45 * 3 - 4, 3), (2**24, 1), (2**24 + 5, 8), (128 * 100 + 64, 8),
               (3 * 2**20 + 1, 2), (2**24, 8), (2**26, 4), (128 * 33, 4), (128 * 16 * 5, 5), (2**26, 2),
               (128 * 17 * 8 - 1, 8), (2**24 + 128 * 3 + 6, 4)]
    for numel, chunks in layouts:
        for sms in (1 / 16, 1, 8, 132):  # waves of 12.5 to 26400 groups
            layout = WireLayout.for_tensor(numel, TacoConfig(), chunks)
            head, body, programs = ends_schedule(layout, sms)
            coded = [[] for _ in range(chunks)]
            for c, groups, masked in program_groups(layout, head, body, programs):
                assert len(groups) > 0, "a program with nothing to code"
                assert masked or groups[-1] < whole_groups(layout, c), "read without masks past the input"
                coded[c] += groups
            assert all(sorted(g) == list(range(layout.groups_per_chunk)) for g in coded), (numel, chunks, sms)
    print(f"compress_ends' mapping: {len(layouts)} layouts at 4 wave sizes, every group coded once")
