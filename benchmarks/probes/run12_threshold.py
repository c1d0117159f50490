"""Run 12: where the library's encoder should stop splitting groups of 128 over 2 lanes:
`triton_kernels.compress_into` with TUNING["split_max_groups"] = 0 (a group a lane) and with
every size split, bf16, 16M..256M values (CUDA graphs, rotated inputs, alternating rounds).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_threshold.py   # GPU
"""
from _probe import compress_sizes, gpu_timings, with_setting
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk

cfg = TacoConfig(backend="triton")


def encoder(split_max_groups):
    def run(x, buf, lay):
        tk.compress_into(x, buf, lay, cfg)
    return with_setting(tk.TUNING, "split_max_groups", split_max_groups, run)


variants = {"one lane": encoder(0), "two lanes": encoder(2**40)}
compress_sizes(gpu_timings(rounds=3), cfg, variants, (16, 20, 24, 28, 32, 48, 64, 256), "one lane")
