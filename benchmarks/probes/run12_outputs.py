"""Run 12: does evict-first on compress's input gain because its output stays in the L2 cache
between calls? The 2-lane encoder plain and with no masks + evict-first input loads, into one
output buffer and into 8 in turn (16M / 24M bf16 values).

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_outputs.py   # H200 only (Gluon)
"""
import torch

from _probe import gpu_timings
from gluon_split import split_launcher
from taco_accel.bench.codec import Rotating
from taco_accel.codec import TacoConfig, WireLayout

cfg = TacoConfig(backend="triton")
COMP = {"2 lanes": split_launcher(2), "no masks, evict first": split_launcher(2, MASKED=False, EVICT="evict_first")}
timings = gpu_timings(rounds=3)
dev = timings.device
for n in (16, 24):
    numel = n * 2**20
    lay = WireLayout.for_tensor(numel, cfg)
    xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16), numel * 2, dev)
    one = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
    outs = Rotating(lambda: torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev), lay.total_bytes, dev)
    fns = {}
    for k, fn in COMP.items():
        fns[k + ", one output"] = lambda fn=fn: fn(xs.next(), one, lay)
        fns[k + ", outputs in turn"] = lambda fn=fn: fn(xs.next(), outs.next(), lay)
    timings.time("compress", n, fns, numel * 2 + lay.total_bytes)
    del xs, outs
    torch.cuda.empty_cache()
timings.table(list(fns))
