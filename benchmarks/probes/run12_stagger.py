"""Run 12 probe: a staggered first wave, and fewer programs per SM, for compress at 16M values.

`run12_tail.py` found the 16M loss in the middle of the kernel: the first wave's 1584 programs
load together, their tiles arrive together, and while they transform, fewer loads are in
flight than at 64M. Here the first wave's programs of round r (program // SMs) sleep r *
STAGGER ns before loading (`gluon_words.compress_words`, STAGGER); other variants cap the
registers for 10 or 8 programs per SM (less in flight: a shorter queue to wait behind).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_stagger.py [out_dir]   # H200 only (Gluon)
"""
import sys

import torch

from _probe import compress_sizes, gpu_timings
from gluon_words import words_launcher as words
from run12_tail import cfg, timeline
from taco_accel.codec import triton_kernels as tk

if not torch.cuda.is_available():
    sys.exit("run12_stagger.py needs a GPU: Gluon kernels do not run in the interpreter")
out_dir = sys.argv[1] if len(sys.argv) > 1 else None
STAGGERS = (50, 100, 200, 400)
COMP = {"library": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg), "words": words(),
        **{f"stagger {ns}": words(STAGGER=ns) for ns in STAGGERS},
        "10 per SM": words(maxnreg=200), "8 per SM": words(maxnreg=240)}

compress_sizes(gpu_timings(rounds=3), cfg, COMP, (16, 32, 64, 256), "library")
for ns in (100, 200):
    timeline(16, dict(STAGGER=ns), f"stagger {ns}", out_dir)
