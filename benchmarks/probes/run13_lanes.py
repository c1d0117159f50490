"""Run 13: three changes to the library's 2-lane encoder (`gluon_split.py`), alone and together,
timed at 16M / 24M / 64M bf16 values into one output buffer and into 8 in turn:

- TRIM: the last two butterfly stages in 96 instructions a lane instead of 128 (`_pair_walsh`);
- WHOLE: the payload's load and store without bounds masks in tiles of whole groups (a branch);
- tail: the last 0.25-1 waves of programs code 8 groups over 4 lanes (shorter warps at the end).

Each variant is first checked against the reference (`encoder_reference_check`) and against
the library at each size (random data), then on groups of mixed +0 / -0 and sparse values,
where TRIM may give a coefficient of 0 the other sign (reported, not asserted).

    cd benchmarks/probes && PYTHONPATH=../..:. python run13_lanes.py [--call2]   # H200 only (Gluon)

--call2: the tail's share against no bounds masks alone, tails of 0.25-1 waves with TRIM,
registers capped at 80, from 16M to 256M values; --call3: 4-lane programs first too.
"""
import sys

import torch

from _probe import compress_sizes, encoder_reference_check, gpu_timings
from gluon_split import split_launcher
from taco_accel.codec import TacoConfig, WireLayout, compress
from taco_accel.codec import triton_kernels as tk

if not torch.cuda.is_available():
    sys.exit("run13_lanes.py needs a GPU: Gluon kernels do not run in the interpreter")
cfg = TacoConfig(backend="triton")
SIZES = (16, 24, 64)
COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
        "2 lanes": split_launcher(2),
        "whole": split_launcher(2, WHOLE=True),
        "trim": split_launcher(2, TRIM=True),
        "trim whole": split_launcher(2, TRIM=True, WHOLE=True),
        "tail 0.25": split_launcher(2, tail_waves=0.25),
        "tail 0.5": split_launcher(2, tail_waves=0.5),
        "tail 1": split_launcher(2, tail_waves=1),
        "tail 0.5, 80 regs": split_launcher(2, tail_waves=0.5, maxnreg=80),
        "trim tail 0.5": split_launcher(2, tail_waves=0.5, TRIM=True)}
if "--call2" in sys.argv:  # the tail's share, registers capped at 80 (25 warps an SM), no masks alone
    SIZES = (16, 20, 24, 32, 64, 256)
    COMP = {"base": COMP["base"], "2 lanes": COMP["2 lanes"],
            "no masks": split_launcher(2, MASKED=False), "trim, no masks": split_launcher(2, MASKED=False, TRIM=True),
            **{f"trim tail {w}": split_launcher(2, tail_waves=w, TRIM=True, maxnreg=80) for w in (0.25, 0.5, 0.75, 1)},
            "tail 0.5": split_launcher(2, tail_waves=0.5, maxnreg=80)}
if "--call3" in sys.argv:  # 4-lane programs first too
    SIZES = (16, 20, 24)
    COMP = {"base": COMP["base"], "tail 0.5": split_launcher(2, tail_waves=0.5, maxnreg=80),
            **{f"head {h} tail {t}": split_launcher(2, tail_waves=t, head_waves=h, maxnreg=80)
               for h, t in ((0.25, 0.5), (0.5, 0.5), (1, 0.5), (0.5, 0.25))},
            "tail 0.4": split_launcher(2, tail_waves=0.4, maxnreg=80), "tail 0.6": split_launcher(2, tail_waves=0.6, maxnreg=80)}
# the variants without masks need whole tiles: the check's default sizes end inside one
encoder_reference_check(cfg, COMP, **({"sizes": (128 * 16 * 64, 128 * 16 * 800)} if "--call2" in sys.argv else {}))

# signed zeros: groups mostly of +0 and -0, a few values between
dev = torch.device("cuda")
numel = 128 * 4096
g = torch.Generator(device=dev).manual_seed(1)
zeros = torch.where(torch.rand(numel, device=dev, generator=g) < 0.5, -0.0, 0.0)
x = torch.where(torch.rand(numel, device=dev, generator=g) < 0.03, torch.randn(numel, device=dev, generator=g),
                zeros).to(torch.bfloat16)
lay = WireLayout.for_tensor(numel, cfg)
ref = compress(x, cfg.replace(backend="torch")).buffer
for name, fn in COMP.items():
    buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
    fn(x, buf, lay)
    diff = (buf != ref).nonzero().flatten()
    pairs = {(int(ref[i]), int(buf[i])) for i in diff[:2000].tolist()}
    print(f"signed zeros {name}: {len(diff)} of {lay.total_bytes} bytes differ from the reference "
          f"(byte pairs ref/kernel {sorted(pairs)[:6]})", flush=True)

compress_sizes(gpu_timings(rounds=3), cfg, COMP, SIZES, "base", outputs_in_turn=True)
