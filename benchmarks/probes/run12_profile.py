"""Run 12 probe: timelines (`run12_tail.timeline`) at 16M values of the words encoder (one group
a lane) and of the encoder with groups over 2 lanes (`gluon_split.py`), in one process.

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_profile.py [out_dir]   # H200 only (Gluon)
"""
import sys

from gluon_split import split_launcher
from run12_tail import timeline

out_dir = sys.argv[1] if len(sys.argv) > 1 else None
timeline(16, {}, "one lane", out_dir)
# the stamps take 95 registers uncapped: capped at the untimed kernel's 80 (25 warps an SM)
timeline(16, dict(tpg=2, maxnreg=80), "two lanes", out_dir, launcher=split_launcher, group_per_program=16)
timeline(64, dict(tpg=2, maxnreg=80), "two lanes", out_dir, launcher=split_launcher, group_per_program=16)
