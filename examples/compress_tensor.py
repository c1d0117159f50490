"""Compress one tensor with the TACO codec and look at what it costs and what it keeps.

    python examples/compress_tensor.py
"""

import torch

import taco_accel

torch.manual_seed(0)
x = torch.randn(4, 1024, 896, dtype=torch.bfloat16)  # an activation-like (b, s, h) tensor
x[0, 0, :4] = 40.0  # a few outliers, as TP activations have

for config in (taco_accel.TacoConfig(), taco_accel.TacoConfig(group_size=32, random_signs=True)):
    packed = taco_accel.compress(x, config)
    y = taco_accel.decompress(packed)
    error = ((y.float() - x.float()).norm() / x.float().norm()).item()
    print(f"G={config.group_size:3d} signs={config.random_signs!s:5}: {packed.nbytes / x.numel():.4f} bytes/element "
          f"({x.numel() * 2 / packed.nbytes:.2f}x smaller than bf16), relative error {error:.4f}, "
          f"shape {tuple(y.shape)} {y.dtype}")
