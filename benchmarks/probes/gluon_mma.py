"""Run 11 probe kernel (Gluon): compress with the first stages of the transform on the tensor cores.

The eleventh run found the Gluon encoder's memory structure at 0.90 of copy bandwidth at 16M
values without the transform and 0.80 with it: its 896 butterfly adds a group are half of its
instructions. Here a warp still encodes 32 groups, but the groups' K-value blocks (K = 16 or 32)
are the rows of one `mma_v2` product with H_K, A[b * 32 + g] = block b of group g. In the
product's register layout each thread holds, for 4 groups, the same columns of every block, so
the remaining log2(G / K) stages pair blocks inside each thread, and a group's max needs 2
shuffles across the 4 lanes that share it. bf16 values are exact in bf16, so one product with
fp32 accumulation; the sums round differently from the reference's butterflies (payloads equal
up to ties, like the tensor-core encoder's).

Single chunk, single scale, no signs, bf16 input: the default config.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from gluon_rows import _scales_of
from taco_accel.codec.gluon_kernels import _barrier, _coalesced, _swizzled, _zero_padding


@gluon.jit
def _hadamard_operand(K: gl.constexpr, layout: gl.constexpr, PERM: gl.constexpr):
    """Sylvester's H_K (+-1 in bf16) in ``layout``: H[i, j] = (-1)^popcount(i & j), for K <= 64.
    PERM: column j is H's column sigma(j) (`_contiguous_columns`)."""
    L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, 1], [1, 0])
    j = gl.arange(0, K, layout=gl.SliceLayout(0, L))
    if PERM:  # j = e + 2 t + 8 h -> sigma(j) = e + 2 h + (K / 4) t
        j = (j & 1) | ((j >> 3) << 1) | (((j >> 1) & 3) << (K // 8).bit_length())
    bits = gl.arange(0, K, layout=gl.SliceLayout(1, L))[:, None] & j[None, :]
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    return gl.convert_layout((1 - 2 * (bits & 1)).to(gl.float32).to(gl.bfloat16), layout)


@gluon.jit
def _contiguous_columns(q, NB: gl.constexpr, K: gl.constexpr):
    """q [NB, 32, K] whose column j holds coefficient sigma(j) -> the same values by coefficient. In
    the product's layout lane t holds columns e + 2 (t % 4) + 8 h (e < 2, h < K / 8): with the
    columns of H permuted so, a lane's values are K / 4 neighbouring coefficients (4-byte stores
    of the payload instead of 2-byte ones)."""
    q = gl.permute(gl.reshape(q, [NB, 32, K // 8, 4, 2]), [0, 1, 3, 2, 4])
    return gl.reshape(q, [NB, 32, K])


@gluon.jit
def _block_stage(y, NB: gl.constexpr, S: gl.constexpr, K: gl.constexpr):
    """Butterflies between blocks b and b + S of y [NB, 32, K] (sum first)."""
    y = gl.reshape(y, [NB // (2 * S), 2, S, 32, K])
    a, b = gl.split(gl.permute(y, [0, 2, 3, 4, 1]))
    return gl.reshape(gl.permute(gl.join(a + b, a - b), [0, 4, 1, 2, 3]), [NB, 32, K])


@gluon.jit
def compress_mma(x_ptr, q_ptr, s_ptr, numel, gpc, G: gl.constexpr, K: gl.constexpr, QMAX: gl.constexpr,
                 TINY: gl.constexpr, chunk_bytes, PAD: gl.constexpr, PERM: gl.constexpr):
    NB: gl.constexpr = G // K
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    L_X: gl.constexpr = _coalesced(G, 1, 2)
    L_Q: gl.constexpr = _coalesced(G, 1, 1)
    r0 = gl.program_id(0) * 32
    rows = r0 + gl.arange(0, 32, layout=gl.SliceLayout(1, L_X))
    offs = rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_X))[None, :]
    x = gl.load(x_ptr + offs, mask=offs < numel, other=0.0)
    # rows b * 32 + g: block b of group g
    blocks = gl.reshape(gl.permute(gl.reshape(x, [32, NB, K]), [1, 0, 2]), [NB * 32, K])
    tile = gl.allocate_shared_memory(gl.bfloat16, [NB * 32, K],
                                     gl.NVMMASharedLayout.get_default_for([NB * 32, K], gl.bfloat16), blocks)
    _barrier()
    acc = mma_v2(tile.load(A_L), _hadamard_operand(K, B_L, PERM), gl.zeros([NB * 32, K], gl.float32, MMA))
    y = gl.reshape(acc, [NB, 32, K])
    for i in gl.static_range(NB.bit_length() - 1):
        y = _block_stage(y, NB, 1 << i, K)

    # blocks first (in each thread), then columns (in-thread, then 2 shuffles); max, not NaN-propagating
    s, mult, _ = _scales_of(gl.max(gl.max(gl.abs(y), axis=0), axis=1), G, QMAX, TINY)
    q = (y * mult[:, None][None, :, :]).to(q_ptr.dtype.element_ty)
    if PERM:
        q = _contiguous_columns(q, NB, K)
    q = gl.reshape(gl.permute(q, [1, 0, 2]), [32, G])  # back to rows of groups
    payload = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [32, G], _swizzled(1), q)
    _barrier()
    q = payload.load(L_Q)
    q_rows = r0 + gl.arange(0, 32, layout=gl.SliceLayout(1, L_Q))
    q_offs = q_rows[:, None] * G + gl.arange(0, G, layout=gl.SliceLayout(0, L_Q))[None, :]
    gl.store(q_ptr + q_offs, q, mask=(q_rows < gpc)[:, None])
    s_rows = r0 + gl.arange(0, 32, layout=s.type.layout)
    gl.store(s_ptr + gpc * (G // 4) + s_rows, s, mask=s_rows < gpc)
    _zero_padding(q_ptr, r0, gpc, chunk_bytes, 1, PAD)
