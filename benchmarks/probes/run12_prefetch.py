"""Run 12 probe: each program asks the L2 for the tile of a program one wave or so later (a bulk
prefetch, `gluon_words._prefetch_tile`), so that DRAM requests stay in flight without holding
registers and a program's own loads mostly hit the L2; for the words encoder (one group a
lane, 12 programs an SM) and the encoder with groups over 2 lanes (25 programs an SM).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_prefetch.py [out_dir]   # H200 only
"""
import sys

import torch

from _probe import compress_sizes, encoder_reference_check, gpu_timings
from gluon_split import split_launcher
from gluon_words import prefetch_launcher
from run12_tail import timeline
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk

if not torch.cuda.is_available():
    sys.exit("run12_prefetch.py needs a GPU: Gluon kernels do not run in the interpreter")
out_dir = sys.argv[1] if len(sys.argv) > 1 else None
cfg = TacoConfig(backend="triton")
COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
        **{f"1 lane, {w} ahead": prefetch_launcher(w) for w in (0.5, 1, 1.5, 2)},
        "2 lanes": split_launcher(2),
        **{f"2 lanes, {w} ahead": split_launcher(2, ahead_waves=w) for w in (0.5, 1, 1.5)}}
encoder_reference_check(cfg, COMP)

compress_sizes(gpu_timings(rounds=3), cfg, COMP, (16, 32, 64, 256), "base")
timeline(16, dict(waves=1), "1 lane, 1 ahead", out_dir, launcher=prefetch_launcher)
