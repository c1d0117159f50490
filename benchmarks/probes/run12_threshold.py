"""Run 12: where the library's encoder should stop splitting groups of 128 over 2 lanes:
`triton_kernels.compress_into` with TUNING["split_max_groups"] = 0 (a group a lane) and with
every size split, bf16, 16M..256M values (CUDA graphs, rotated inputs, alternating rounds).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_threshold.py   # GPU
"""
from _probe import compress_sizes, gpu_timings, library_encoder
from taco_accel.codec import TacoConfig

cfg = TacoConfig(backend="triton")
variants = {"one lane": library_encoder(cfg, split_max_groups=0),
            "two lanes": library_encoder(cfg, split_max_groups=2**40)}
compress_sizes(gpu_timings(rounds=3), cfg, variants, (16, 20, 24, 28, 32, 48, 64, 256), "one lane")
