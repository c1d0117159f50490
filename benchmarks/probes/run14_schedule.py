"""Run 14: the library's split schedule (`gluon_kernels.split_schedule`) around its settings,
and compress into P chunks, the two-shot all-reduce's layout, which no run has timed yet.

1. 16M-32M bf16 values, into one output and into 8 in turn: the library as it is (4-lane
   programs over the first 0.25 and last 0.5 wave, head masked); heads of 0, 0.125 and 0.375
   waves; tails of 0.375, 0.625 and 0.75 waves; a group a lane; and run 13's probe schedule
   (`gluon_split.split_launcher`, its head read without masks: 0.848 at 16M in run 13's third
   call, where the library read 0.843 in the fourth), now in the same call; and
   `gluon_ends.compress_ends`, which with one chunk is the library's kernel with the head read
   without masks.
2. P = 1, 2, 4, 8 chunks at 16M and 64M: the library, a group a lane, the split schedule at
   64M too, the split schedule without 4-lane programs (each chunk takes its share of the head
   and tail waves, so for P > 1 they run mid-kernel too), and `gluon_ends.compress_ends`, which
   gives chunk 0 the whole head and the last chunk the whole tail.

Every variant first writes the bytes the library writes (`compress_sizes` asserts it), after
`encoder_reference_check` against the reference codec; `compress_ends`, never run before, is
first compared with the library on odd sizes and chunk counts, and left out if it differs or
does not build.

    cd benchmarks/probes && PYTHONPATH=../..:. python run14_schedule.py   # H200 (Gluon)
"""
import sys

import torch

from _probe import Timings, compress_sizes, encoder_reference_check, gpu_timings, library_encoder, with_setting
import gluon_ends
from gluon_split import split_launcher
from taco_accel.codec import TacoConfig, WireLayout
from taco_accel.codec import gluon_kernels as gk

if not torch.cuda.is_available():
    sys.exit("run14_schedule.py needs a GPU: Gluon kernels do not run in the interpreter")
cfg = TacoConfig(backend="triton")
split = library_encoder(cfg, split_max_groups=2**40)  # split at every size
ends = with_setting(vars(gk), "_compress_rows_kernel", gluon_ends.compress_ends,
                    with_setting(vars(gk), "split_schedule", gluon_ends.ends_schedule, split))


def ends_agrees(dev: torch.device) -> bool:
    """`compress_ends` against the library, bytes of poisoned buffers, odd sizes and chunk counts.
    A build error leaves it out (the library's fallback would have disabled every Gluon kernel)."""
    for numel, chunks in ((128 * 5000 + 70, 1), (128 * 16 * 700 + 2, 2), (128 * 16 * 333 + 128 * 5 + 64, 3),
                          (2**22 + 6, 8), (2**22, 5), (2**24 + 128 * 3 + 6, 4)):
        x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
        lay = WireLayout.for_tensor(numel, cfg, chunks)
        bufs = [torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device=dev) for _ in range(2)]
        split(x, bufs[0], lay)
        try:
            ends(x, bufs[1], lay)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a probe's failure must not end the run
            print(f"ends check {numel} values, {chunks} chunks: {type(error).__name__}: {error}", flush=True)
            return False
        if not gk.AVAILABLE:
            return False
        differ = int((bufs[0] != bufs[1]).sum())
        print(f"ends check {numel} values, {chunks} chunks: {differ} bytes differ from the library", flush=True)
        if differ:
            return False
    return True


timings = gpu_timings(rounds=5)
probe_ends = {"ends": ends}
if not ends_agrees(timings.device):
    print("compress_ends left out: it differs from the library or does not build", flush=True)
    gk.AVAILABLE = True
    probe_ends = {}

waves = {"library": library_encoder(cfg), "one lane": library_encoder(cfg, split_max_groups=0),
         **{f"head {h}": library_encoder(cfg, dict(HEAD_WAVES=h)) for h in (0, 0.125, 0.375)},
         **{f"tail {t}": library_encoder(cfg, dict(TAIL_WAVES=t)) for t in (0.375, 0.625, 0.75)},
         "probe h0.25 t0.5": split_launcher(2, tail_waves=0.5, head_waves=0.25, maxnreg=80), **probe_ends}
encoder_reference_check(cfg, {"base": waves["library"], **waves})
compress_sizes(timings, cfg, waves, (16, 20, 24, 32), "library", outputs_in_turn=True)

timings = Timings(timings.device, timings.copy_bw, timings.rounds)  # a table of its own
chunked = {"library": library_encoder(cfg), "one lane": library_encoder(cfg, split_max_groups=0), "split": split,
           "split, no 4 lanes": library_encoder(cfg, dict(HEAD_WAVES=0, TAIL_WAVES=0), split_max_groups=2**40),
           **probe_ends}
for p in (1, 2, 4, 8):
    compress_sizes(timings, cfg, chunked, (16, 64), "library", chunks=p, table=p == 8)
