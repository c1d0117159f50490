"""Run 12 probe: compress with each group split over 2 or 4 lanes (`gluon_split.py`), and hybrids
whose first and / or last waves of programs split their groups over 2 lanes, against the
library's encoder (one group per lane): payload and scales checked against the reference and
the library, then timed alternately at 16M / 32M / 64M / 256M bf16 values (CUDA graphs,
rotated inputs).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_split.py   # H200 only (Gluon)
"""
import sys

import torch

from _probe import compress_sizes, encoder_reference_check, gpu_timings
from gluon_split import hybrid_launcher, split_launcher
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk

if not torch.cuda.is_available():
    sys.exit("run12_split.py needs a GPU: Gluon kernels do not run in the interpreter")
cfg = TacoConfig(backend="triton")
SIZES = (16, 32, 64, 256)
# call 4: 4 lanes, and hybrids with split first / last waves; call 5: warps per program, registers
VARIANTS = {"4 lanes": split_launcher(4),
            **{f"split {h}+{t}": hybrid_launcher(h, t) for h, t in ((0, 1), (0, 2), (1, 1), (0.5, 0.5), (1, 0))}}
if "--call10" in sys.argv:  # the library splits up to 24M values: masks and eviction policy there
    VARIANTS = {"2 lanes, no masks": split_launcher(2, MASKED=False),
                "2 lanes, evict first": split_launcher(2, EVICT="evict_first"),
                "2 lanes, both": split_launcher(2, MASKED=False, EVICT="evict_first")}
    SIZES = (16, 20, 24)
if "--call5" in sys.argv:
    VARIANTS = {"2 lanes, 2 warps": split_launcher(2, 2), "2 lanes, 4 warps": split_launcher(2, 4),
                "2 lanes, 72 regs": split_launcher(2, maxnreg=72), "2 lanes, 64 regs": split_launcher(2, maxnreg=64),
                "2 lanes, 2 warps, 64 regs": split_launcher(2, 2, maxnreg=64)}
COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
        "2 lanes": split_launcher(2), **VARIANTS}
# the variants without masks need whole tiles: the check's default sizes end inside one
encoder_reference_check(cfg, COMP, **({"sizes": (128 * 16 * 64, 128 * 16 * 800)} if "--call10" in sys.argv else {}))

compress_sizes(gpu_timings(rounds=3), cfg, COMP, SIZES, "base")
