"""Run 12: the kernels for Nsight Compute at 16M bf16 values, each launched twice (the second is
the one to read): the library's encoder, its words probe without the transform and without
bounds masks, the library's decoder; with --split, the encoder with groups over 2 lanes
(`gluon_split.py`) and torch's copy of the input instead.

    ncu --clock-control none --launch-skip-before-match 0 -k regex:"compress|decompress" \\
        --section SpeedOfLight ... python run12_ncu_target.py
"""
import sys

import torch

from gluon_words import words_launcher
from taco_accel.codec import TacoConfig, WireLayout
from taco_accel.codec import triton_kernels as tk

cfg = TacoConfig(backend="triton")
numel = 16 * 2**20
lay = WireLayout.for_tensor(numel, cfg)
dev = torch.device("cuda")
x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
out = torch.empty_like(x)


def words(**flags):
    words_launcher(**flags)(x, buf, lay)


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
