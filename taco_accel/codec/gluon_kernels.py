"""Decompress with one group per thread, in Gluon (Triton's language with explicit layouts).

For G <= 128 on NVIDIA GPUs this is the decoder `triton_kernels.decompress_into` launches; the
tensor-core kernel of `triton_kernels` decodes larger groups and runs in the CPU interpreter,
which cannot run Gluon. Both implement the same formula as `reference.decompress_into`.

Each thread holds a whole group in registers and transforms it with log2(G) butterfly stages
(G/2 adds and G/2 subtracts each, in the reference's order: stride 1 first), so there are no
tensor-core products, no cross-lane reductions and no software pipeline. Memory is touched in
layouts where a warp covers whole rows, 16 bytes per lane; one layout conversion each way moves
the tile through shared memory. A warp decodes 32 groups per program; with about 170 registers
per thread 12 warps fit on an SM, and their independent programs keep the loads in flight.

H200, bf16 output, G = 128, against the tensor-core kernel (benchmarks/RESULTS.md, tenth run):
0.88 / 0.94 / 0.97 of copy bandwidth at 16M / 64M / 256M values, against 0.75 / 0.84 / 0.87.
Triton's block language can say the same arithmetic but places values on lanes itself: loaded
sub-block by sub-block it made every lane read a different row (0.3-0.6 of copy bandwidth,
ninth run), loaded whole it compiles to extra shuffles and conversions (about 20% more
instructions, 194 registers, tenth run).
"""

from __future__ import annotations

import warnings

import torch
import triton

from .config import TacoConfig
from .hadamard import device_signs
from .layout import PAYLOAD_DTYPES, WireLayout

try:  # experimental in triton; used here as in 3.6 (the H200's) and 3.9 (compiled in CPU tests)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    AVAILABLE = hasattr(gl, "BlockedLayout") and hasattr(gluon, "constexpr_function")
except ImportError:  # pragma: no cover - old triton: the tensor-core kernel decodes every group size
    AVAILABLE = False

MAX_GROUP = 128  # a group's G fp32 values live in one thread: 167 registers at 128, G = 256 cannot fit

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

    @gluon.jit
    def _walsh(y, L_ROW: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr):
        """``y @ H_G`` for the rows of y (unnormalised, Sylvester order), in each thread's registers."""
        for i in gl.static_range(G.bit_length() - 1):
            y = _stage(y, ROWS, G, 1 << i)
        return gl.convert_layout(y, L_ROW)  # the stages only renumbered registers

    @gluon.jit
    def _decompress_rows_kernel(
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
        c = gl.program_id(1)
        r0 = gl.program_id(0) * ROWS
        if WIDE:
            c = c.to(gl.int64)
            r0 = r0.to(gl.int64)
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
            y = _walsh(y, L_ROW, ROWS, G)
            scale = scale * (G**-0.5)
        x = gl.convert_layout((y * scale[:, None]).to(out_ptr.dtype.element_ty), L_OUT)

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


# Warps per program: one (32 groups) measured best on an H200, before 2 and 4 (RESULTS.md, tenth run).
WARPS = 1


def disable(error: Exception) -> None:
    """Stop using this decoder (this triton's Gluon could not build it), with one warning."""
    global AVAILABLE
    AVAILABLE = False
    first = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    warnings.warn(f"taco_accel: the Gluon decoder does not compile with triton {triton.__version__} ({first}); "
                  "decompress falls back to the tensor-core kernel (about 0.1 of copy bandwidth slower on an "
                  "H200). Gluon's API changes between triton releases: please report your triton version.",
                  RuntimeWarning, stacklevel=3)


def decompress_rows_into(buffer: torch.Tensor, layout: WireLayout, config: TacoConfig, out: torch.Tensor) -> None:
    """Decode ``buffer`` into the flat contiguous tensor ``out``; G <= `MAX_GROUP`, CUDA only."""
    rows = 32 * WARPS
    per_chunk = triton.cdiv(layout.groups_per_chunk, rows)
    payload = buffer.view(PAYLOAD_DTYPES[config.format])
    wide = max(layout.total_bytes, layout.chunks * layout.groups_per_chunk * config.group_size * out.element_size())
    _decompress_rows_kernel[(max(1, per_chunk), layout.chunks)](
        payload, buffer.view(torch.float32), out, device_signs(config, buffer.device),
        layout.numel, layout.groups_per_chunk, layout.chunk_bytes,
        G=config.group_size, NW=WARPS, Q_BYTES=payload.element_size(), OUT_BYTES=out.element_size(),
        HADAMARD=config.hadamard, SIGNS=config.random_signs, DUAL=config.scales == "dual",
        CHUNKED=layout.chunks > 1, WIDE=wide >= 2**31, num_warps=WARPS,
    )
