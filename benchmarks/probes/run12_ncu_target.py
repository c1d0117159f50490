"""Run 12: the kernels for Nsight Compute at 16M bf16 values, each launched twice (the second is
the one to read): the library's encoder, its words probe without the transform and without
bounds masks, the library's decoder; with --split, the encoder with groups over 2 lanes
(`gluon_split.py`) and torch's copy of the input instead.

    ncu --clock-control none --launch-skip-before-match 0 -k regex:"compress|decompress" \\
        --section SpeedOfLight ... python run12_ncu_target.py
"""
import sys

import torch
import triton

from gluon_words import compress_words
from taco_accel.codec import TacoConfig, WireLayout
from taco_accel.codec import triton_kernels as tk
from taco_accel.codec.reference import TINY_AMAX

cfg = TacoConfig(backend="triton")
numel = 16 * 2**20
lay = WireLayout.for_tensor(numel, cfg)
dev = torch.device("cuda")
x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
out = torch.empty_like(x)


def words(**flags):
    compress_words[(triton.cdiv(lay.groups_per_chunk, 32),)](
        x.view(torch.int32), buf.view(torch.float8_e4m3fn), buf.view(torch.float32), numel // 2,
        lay.groups_per_chunk, G=128, NW=1, QMAX=448.0, TINY=TINY_AMAX, chunk_bytes=lay.chunk_bytes,
        PAD=lay.chunk_bytes - lay.used_bytes, RARE_BAD=True, SMEM=True, num_warps=1, **flags)


for _ in range(2):
    tk.compress_into(x, buf, lay, cfg)
if "--split" in sys.argv:
    from gluon_split import split_launcher

    for _ in range(2):
        split_launcher(2)(x, buf, lay)
    for _ in range(2):
        out.copy_(x)
    torch.cuda.synchronize()
    sys.exit()
for _ in range(2):
    words(HADAMARD=False)
for _ in range(2):
    words(MASKED=False)
for _ in range(2):
    tk.decompress_into(buf, lay, cfg, out)
torch.cuda.synchronize()
print("done")
