"""Run 10 probe: one group per thread in Gluon (`gluon_rows.py`) against the committed kernels.

    PYTHONPATH=. python benchmarks/probes/run10_gluon.py   # H200 only: Gluon has no interpreter

Checks the Gluon kernels against the reference codec (odd sizes, NaN / Inf groups, tiny and huge
groups) and the committed kernels, then times them alternately (CUDA graphs, rotated inputs).
"""
import sys

import torch
import triton

from _probe import codec_table, gpu_timings, persistent
from gluon_rows import compress_rows, compress_rows_ring, decompress_rows, decompress_rows_ring
from taco_accel.codec import TacoConfig, WireLayout, compress, decompress
from taco_accel.codec import triton_kernels as tk
from taco_accel.codec.reference import TINY_AMAX

if not torch.cuda.is_available():
    sys.exit("run10_gluon.py needs a GPU: Gluon kernels do not run in the interpreter")
dev = torch.device("cuda")
cfg = TacoConfig(backend="triton")
G = 128


def g_compress(nw):
    def run(x, buf, lay):
        assert lay.chunks == 1
        compress_rows[(triton.cdiv(lay.groups_per_chunk, 32 * nw),)](
            x, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.numel, lay.groups_per_chunk,
            G=G, NW=nw, QMAX=448.0, TINY=TINY_AMAX, X_BYTES=x.element_size(),
            chunk_bytes=lay.chunk_bytes, PAD=lay.chunk_bytes - lay.used_bytes, num_warps=nw)
    return run


def g_decompress(nw):
    def run(buf, lay, out):
        decompress_rows[(triton.cdiv(lay.groups_per_chunk, 32 * nw),)](
            buf.view(torch.float8_e4m3fn), buf.view(torch.float32), out, lay.numel, lay.groups_per_chunk,
            G=G, NW=nw, OUT_BYTES=out.element_size(), num_warps=nw)
    return run


def ring_compress(nw, stages):
    def run(x, buf, lay):
        persistent(compress_rows_ring, triton.cdiv(lay.groups_per_chunk, 32 * nw), nw,
                   (x, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.numel, lay.groups_per_chunk),
                   dict(G=G, NW=nw, QMAX=448.0, TINY=TINY_AMAX, X_BYTES=x.element_size(), chunk_bytes=lay.chunk_bytes,
                        PAD=lay.chunk_bytes - lay.used_bytes, STAGES=stages))
    return run


def ring_decompress(nw, stages):
    def run(buf, lay, out):
        persistent(decompress_rows_ring, triton.cdiv(lay.groups_per_chunk, 32 * nw), nw,
                   (buf.view(torch.float8_e4m3fn), buf.view(torch.float32), out, lay.numel, lay.groups_per_chunk),
                   dict(G=G, NW=nw, OUT_BYTES=out.element_size(), STAGES=stages))
    return run


COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg), "rows w1": g_compress(1)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out), "rows w1": g_decompress(1),
       "rows w2": g_decompress(2)}
for nw, stages in ((1, 2), (1, 3), (2, 2)):
    COMP[f"ring w{nw} s{stages}"] = ring_compress(nw, stages)
    DEC[f"ring w{nw} s{stages}"] = ring_decompress(nw, stages)

# against the reference codec: sizes that end inside a group and a tile, groups of every kind
ref_cfg = cfg.replace(backend="torch")
torch.manual_seed(0)
for numel in (128 * 1000 + 128 * 4, 128 * 12345 + 64):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(numel, device=dev) * torch.logspace(-6, 6, numel, device=dev)
        x[128 * 7 + 3] = float("nan")
        x[128 * 9 + 5] = float("inf")
        x[128 * 11: 128 * 12] = 1e-35
        x[128 * 13: 128 * 14] = 0.0
        x = x.to(dtype)
        lay = WireLayout.for_tensor(numel, cfg)
        ref = compress(x, ref_cfg)
        want = decompress(ref).float()
        for name, fn in COMP.items():
            buf = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device=dev)
            fn(x, buf, lay)
            diff = (buf != ref.buffer).nonzero().flatten()
            pay = diff[diff < lay.groups_per_chunk * G]
            print(f"ref check {numel} {dtype} compress {name}: {len(diff)} bytes differ from the reference: "
                  f"payload groups {(pay // G).unique().tolist()[:12]}, other bytes {diff[diff >= lay.groups_per_chunk * G].tolist()[:12]}")
        for name, fn in DEC.items():
            out = torch.full((numel,), -1.0, dtype=torch.bfloat16, device=dev)
            fn(ref.buffer, lay, out)
            ok = torch.isfinite(want)
            err = ((out.float() - want).abs()[ok].max() / want[ok].abs().max()).item()
            same_nan = torch.equal(torch.isnan(out.float()), torch.isnan(want))
            print(f"ref check {numel} decompress {name}: max |diff| / max {err:.1e}, NaN where the reference {same_nan}")
            assert err < 1e-2 and same_nan, name

codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
