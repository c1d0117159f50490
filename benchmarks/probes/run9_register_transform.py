"""Run 9 probe: the transform as butterflies in registers instead of tensor-core products.

G = 128, one group per thread, one program per tile of BG groups, no shared memory, no persistent
loop: the group's 128 values are NSUB = 128 / SUB sub-block tensors [BG, SUB] (SUB = 8 or 16, a
whole sub-block row per thread), H_SUB inside each by reshape / split / join (registers only),
H_NSUB as butterflies between sub-blocks of one layout. Compiled for sm_90 (triton 3.9): no
shared memory, no barriers, 1456-1464 SASS instructions per thread and group for decompress,
2168-2192 for compress. bf16 / e4m3 / single scale / no signs: enough to time the idea.

    PYTHONPATH=. python benchmarks/probes/run9_register_transform.py                     # H200
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/probes/run9_register_transform.py  # CPU check

On the GPU: checked against the committed kernels, then timed alternately with them (CUDA
graphs, rotated inputs, median of 2 rounds). Without CUDA: checked against the reference only.
Result (benchmarks/RESULTS.md, ninth run): 0.28-0.59 of copy bandwidth, the committed kernels
0.75-0.91. Each warp load / store touches 32 rows, so nothing is coalesced.
"""
import sys

import torch
import triton

from _probe import codec_table, gpu_timings, load_module
from taco_accel.codec import TacoConfig, WireLayout, compress, decompress
from taco_accel.codec import triton_kernels as tk

HELPERS = '''
import triton
import triton.language as tl
from taco_accel.codec.triton_kernels import (_chunk_tile, _payload_offsets, _row_stats, _scale_offsets, _scales,
                                             _store_padding, _store_payload, _store_scales, _tile_values)


@triton.jit
def _stage(x, BG: tl.constexpr, W: tl.constexpr, H: tl.constexpr):
    # one butterfly stage on each row of x [BG, W]: pairs (i, i + H) inside blocks of 2H values
    if W > H:
        x = tl.reshape(x, (BG, W // (2 * H), 2, H))
        a, b = tl.split(tl.permute(x, (0, 1, 3, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BG, W))
    return x


@triton.jit
def _hw(x, BG: tl.constexpr, W: tl.constexpr):
    # Sylvester H_W (W = 8 or 16) on each row, unnormalised
    x = _stage(x, BG, W, 1)
    x = _stage(x, BG, W, 2)
    x = _stage(x, BG, W, 4)
    return _stage(x, BG, W, 8)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _st_dec(out_blk, offs8, left, x, scale, j: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr):
    # decoded sub-block j as [BG, 8] pieces: 8 values per thread, one 16-byte bf16 store
    x = x * scale[:, None]
    if SUB == 8:
        tl.store(out_blk + offs8 + j * 8, x.to(out_blk.dtype.element_ty), mask=offs8 + j * 8 < left)
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, (BG, 2, SUB // 2)), (0, 2, 1)))
        o = offs8 + j * SUB
        tl.store(out_blk + o, a.to(out_blk.dtype.element_ty), mask=o < left)
        tl.store(out_blk + o + 8, b.to(out_blk.dtype.element_ty), mask=o + 8 < left)
'''


def _cross(n: int, var: str) -> list[str]:
    """Butterflies between n sub-block tensors: H_n across them, Sylvester order."""
    lines, h = [], 1
    while h < n:
        lines += [f"    {var}{i}, {var}{i + h} = _bf({var}{i}, {var}{i + h})" for i in range(n) if not i & h]
        h *= 2
    return lines


def _kernels(sub: int) -> str:
    n = 128 // sub
    head = '''

@triton.jit
def _{kind}_reg{sub}_kernel({ptrs}, numel, gpc, chunk_bytes, tiles_per_chunk, G: tl.constexpr, BG: tl.constexpr{extra}):
    c, r0, g_mask = _chunk_tile(tl.program_id(0), tiles_per_chunk, gpc, BG)'''
    dec = [head.format(kind="dec", sub=sub, ptrs="q_ptr, s_ptr, out_ptr", extra=""),
           "    scale = tl.load(s_ptr + _scale_offsets(c, r0, gpc, chunk_bytes, G, BG), mask=g_mask, other=0.0) * (G**-0.5)",
           f"    out_blk, offs, left = _tile_values(out_ptr, c, r0, gpc, numel, G, {sub}, BG)",
           "    _, offs8, _ = _tile_values(out_ptr, c, r0, gpc, numel, G, 8, BG)",
           "    q_blk = q_ptr + _payload_offsets(c, r0, chunk_bytes, G)"]
    dec += [f"    x{j} = _hw(tl.load(q_blk + offs + {j * sub}, mask=g_mask[:, None]).to(tl.float32), BG, {sub})"
            for j in range(n)]
    dec += _cross(n, "x") + [f"    _st_dec(out_blk, offs8, left, x{j}, scale, {j}, {sub}, BG)" for j in range(n)]
    comp = [head.format(kind="comp", sub=sub, ptrs="x_ptr, q_ptr, s_ptr",
                        extra=", PAD: tl.constexpr, EMULATE_ROUND: tl.constexpr"),
            f"    x_blk, offs, left = _tile_values(x_ptr, c, r0, gpc, numel, G, {sub}, BG)",
            "    q_blk = q_ptr + _payload_offsets(c, r0, chunk_bytes, G)"]
    comp += [f"    y{j} = _hw(tl.load(x_blk + offs + {j * sub}, mask=offs + {j * sub} < left, other=0.0)"
             f".to(tl.float32), BG, {sub})" for j in range(n)]
    comp += _cross(n, "y") + ["    amax = tl.zeros((BG,), tl.float32)", "    sumsq = tl.zeros((BG,), tl.float32)"]
    comp += [f"    amax, sumsq = _row_stats(y{j}, amax, sumsq, False)" for j in range(n)]
    comp += ["    a, s, mult, bad = _scales(amax, sumsq, tl.zeros((BG,), tl.int1), G**-0.5, G, 448.0, False, False)"]
    comp += [f"    _store_payload(q_blk, offs + {j * sub}, y{j}, mult, bad, g_mask[:, None], 0, 448.0, EMULATE_ROUND)"
             for j in range(n)]
    comp += ["    _store_scales(s_ptr, c, r0, g_mask, s, a, gpc, chunk_bytes, G, BG, False)",
             "    _store_padding(q_ptr, c, r0, gpc, chunk_bytes, PAD, BG)"]
    return "\n".join(dec + comp) + "\n"


CPU = not torch.cuda.is_available()
dev = torch.device("cpu" if CPU else "cuda")
cfg = TacoConfig(backend="triton")
G = 128
fp = load_module("register_transform", HELPERS + _kernels(8) + _kernels(16))


def reg_compress(kern, bg, warps):
    def run(x, buf, lay):
        tiles = triton.cdiv(lay.groups_per_chunk, bg)
        kern[(tiles * lay.chunks,)](x, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.numel,
                                    lay.groups_per_chunk, lay.chunk_bytes, tiles, G=G, BG=bg,
                                    PAD=lay.chunk_bytes - lay.used_bytes, EMULATE_ROUND=CPU, num_warps=warps)
    return run


def reg_decompress(kern, bg, warps):
    def run(buf, lay, out):
        tiles = triton.cdiv(lay.groups_per_chunk, bg)
        kern[(tiles * lay.chunks,)](buf.view(torch.float8_e4m3fn), buf.view(torch.float32), out, lay.numel,
                                    lay.groups_per_chunk, lay.chunk_bytes, tiles, G=G, BG=bg, num_warps=warps)
    return run


# "r16 w2": sub-blocks of 16, tiles of 64 groups, 2 warps (one group per thread throughout)
COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
        "r8 w4": reg_compress(fp._comp_reg8_kernel, 128, 4),
        "r16 w4": reg_compress(fp._comp_reg16_kernel, 128, 4),
        "r16 w2": reg_compress(fp._comp_reg16_kernel, 64, 2),
        "r16 w1": reg_compress(fp._comp_reg16_kernel, 32, 1)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out),
       "r8 w4": reg_decompress(fp._dec_reg8_kernel, 128, 4),
       "r16 w4": reg_decompress(fp._dec_reg16_kernel, 128, 4),
       "r16 w2": reg_decompress(fp._dec_reg16_kernel, 64, 2),
       "r8 w1": reg_decompress(fp._dec_reg8_kernel, 32, 1),
       "r16 w1": reg_decompress(fp._dec_reg16_kernel, 32, 1)}

if CPU:  # the probe kernels against the reference codec, in the interpreter
    ref_cfg = cfg.replace(backend="torch")
    for numel in (128 * 40 + 17, 128 * 3):
        x = (torch.randn(numel) * torch.logspace(-3, 2, numel)).to(torch.bfloat16)
        lay = WireLayout.for_tensor(numel, cfg)
        ref = compress(x, ref_cfg)
        want = decompress(ref)
        for name, fn in COMP.items():
            buf = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8)
            fn(x, buf, lay)
            differ = (buf != ref.buffer).float().mean().item()
            print(f"{numel} compress {name}: bytes differing from the reference {differ:.1e}")
            assert differ < 0.01
        for name, fn in DEC.items():
            out = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
            fn(ref.buffer, lay, out)
            err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
            print(f"{numel} decompress {name}: max |diff| / max against the reference {err:.1e}")
            assert torch.isfinite(out).all() and err < 1e-2
    sys.exit(0)

codec_table(gpu_timings(rounds=2), cfg, COMP, DEC)
