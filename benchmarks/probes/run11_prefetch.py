"""Run 11: a persistent Gluon encoder that loads its next tile into registers before it encodes
this one (`gluon_words.compress_words_prefetch`), against the library's encoder.

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_prefetch.py   # GPU
"""
import torch
import triton

from _probe import codec_table, gpu_timings, persistent
from gluon_words import compress_words_prefetch, words_operands
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk

cfg = TacoConfig(backend="triton")


def prefetch(maxnreg=None):
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

    def run(x, buf, lay):
        args, named = words_operands(x, buf, lay)
        persistent(compress_words_prefetch, triton.cdiv(lay.groups_per_chunk, 32), 1, args, dict(named, NW=1, **extra))
    return run


COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg), "prefetch": prefetch(),
        "prefetch 200": prefetch(200), "prefetch 168": prefetch(168)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out)}
assert torch.cuda.is_available()
codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
