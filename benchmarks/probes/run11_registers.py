"""Run 11: the library's Gluon encoder and decoder with their registers capped
(`gluon_kernels.MAX_REGISTERS`), so that more warps fit on an SM: 158 / 167 registers by the
compiler's choice (12 warps per SM); 144 (14 warps, no spills on sm_90); 128 (16 warps, 24 values
spilled to local memory in compress).

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_registers.py   # GPU
"""
import torch

from _probe import codec_table, gpu_timings, with_setting
from taco_accel.codec import TacoConfig
from taco_accel.codec import gluon_kernels as gk
from taco_accel.codec import triton_kernels as tk

cfg = TacoConfig(backend="triton")
COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out)}
for cap in (144, 128):
    COMP[f"cap {cap}"] = with_setting(gk.MAX_REGISTERS, "compress", cap, COMP["base"])
    DEC[f"cap {cap}"] = with_setting(gk.MAX_REGISTERS, "decompress", cap, DEC["base"])
assert torch.cuda.is_available()
codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
