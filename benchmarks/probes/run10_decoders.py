"""Run 10: the library's two decoders side by side, G = 32 / 64 / 128, bf16 output.

    PYTHONPATH=. python benchmarks/probes/run10_decoders.py   # GPU

"gluon": `gluon_kernels` (one group per thread, the default for G <= 128 on CUDA); "tensor
core": the `triton_kernels` decoder (TUNING["rows_max_group"] = 0). Timed alternately on
rotated payloads (CUDA graphs, median of 3 rounds), into one output buffer and into 8 in turn.
"""
import torch

from _probe import decoder_rows, gpu_timings, library_decoder
from taco_accel.codec import TacoConfig


def report(g, n):
    def check(outs):
        tc = outs["tensor core"].float()
        err = (outs["gluon"].float() - tc).abs().max() / tc.abs().max()
        print(f"G={g} {n}M: max |gluon - tensor core| / max {err.item():.1e}", flush=True)
    return check


timings = gpu_timings(rounds=3)
for g in (32, 64, 128):
    cfg = TacoConfig(group_size=g, backend="triton")
    dec = {"gluon": library_decoder(cfg), "tensor core": library_decoder(cfg, 0)}
    for n in (16, 64, 256):
        decoder_rows(timings, f"G={g} ", n, cfg, dec, check=report(g, n))
        torch.cuda.empty_cache()
timings.table(["gluon", "tensor core"])
