"""Run 11: how much of compress's time at 16M is the transform, in the library's Gluon encoder and
tensor-core encoder: the default config against hadamard=False (no butterflies, the same loads,
scales and stores), bf16, G = 128, 16M / 32M / 64M values.

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_transform_share.py   # GPU
"""
import torch

from _probe import gpu_timings, library_encoder
from taco_accel.bench.codec import Rotating
from taco_accel.codec import TacoConfig, WireLayout

cfg = TacoConfig(backend="triton")
plain = cfg.replace(hadamard=False)
variants = {"gluon": library_encoder(cfg, rows_max_group=128),
            "gluon, no transform": library_encoder(plain, rows_max_group=128),
            "tensor core": library_encoder(cfg, rows_max_group=0),
            "tensor core, no transform": library_encoder(plain, rows_max_group=0)}
timings = gpu_timings(rounds=3)
dev = timings.device
for n in (16, 32, 64):
    numel = n * 2**20
    lay = WireLayout.for_tensor(numel, cfg)
    xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16), numel * 2, dev)
    bufs = {k: torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev) for k in variants}
    timings.time("compress", n, {k: (lambda fn=fn, k=k: fn(xs.next(), bufs[k], lay)) for k, fn in variants.items()},
                 numel * 2 + lay.total_bytes)
    torch.cuda.empty_cache()
timings.table(list(variants))
