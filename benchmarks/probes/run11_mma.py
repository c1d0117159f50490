"""Run 11: the encoder with the first stages of the transform on the tensor cores
(`gluon_mma.compress_mma`, K = 16 or 32, columns of H permuted or not) against the library's
Gluon encoder, bf16, G = 128.

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_mma.py   # GPU

Checks each variant against the reference codec first (finite values only: the probe's max does
not propagate NaN), then times them alternately at 16M / 64M / 256M values.
"""
import torch
import triton

from _probe import codec_table, gpu_timings
from gluon_mma import compress_mma
from taco_accel.codec import TacoConfig, WireLayout, compress
from taco_accel.codec import triton_kernels as tk
from taco_accel.codec.reference import TINY_AMAX

dev = torch.device("cuda")
cfg = TacoConfig(backend="triton")


def mma(k, perm):
    def run(x, buf, lay):
        compress_mma[(triton.cdiv(lay.groups_per_chunk, 32),)](
            x, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.numel, lay.groups_per_chunk,
            G=128, K=k, QMAX=448.0, TINY=TINY_AMAX, chunk_bytes=lay.chunk_bytes, PAD=lay.chunk_bytes - lay.used_bytes,
            PERM=perm, num_warps=1)
    return run


COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg), "mma 16": mma(16, False),
        "mma 16 perm": mma(16, True), "mma 32 perm": mma(32, True)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out)}

torch.manual_seed(0)
for numel in (128 * 1000 + 128 * 4, 128 * 12345 + 64):
    x = torch.randn(numel, device=dev) * torch.logspace(-6, 6, numel, device=dev)
    x[128 * 11: 128 * 12] = 1e-35
    x[128 * 13: 128 * 14] = 0.0
    x = x.to(torch.bfloat16)
    lay = WireLayout.for_tensor(numel, cfg)
    ref = compress(x, cfg.replace(backend="torch"))
    payload = lay.groups_per_chunk * 128
    qr = lay.payload(ref.buffer, "e4m3").float()
    for name, fn in COMP.items():
        buf = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device=dev)
        fn(x, buf, lay)
        qt = lay.payload(buf, "e4m3").float()
        differ = qr != qt
        step = (qr[differ] - qt[differ]).abs() / qr[differ].abs().clamp_min(2**-9)
        sr, st = lay.scales(ref.buffer), lay.scales(buf)
        srel = ((st - sr).abs() / sr.abs().clamp_min(1e-38)).max().item()
        pad = lay.padding(buf).any().item()
        print(f"ref check {numel} {name}: payload differs on {differ.float().mean().item():.2e} of values "
              f"(largest step {step.max().item() if differ.any() else 0:.3f} of the value), scales within {srel:.1e}, "
              f"padding written {not pad}", flush=True)
        assert differ.float().mean() < 5e-3 and srel < 1e-5 and not pad, name

codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
