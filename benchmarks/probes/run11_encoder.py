"""Run 11 probe: Gluon encoders with fewer instructions per group (`gluon_words.py`) against the
committed kernel and the run 10 encoders.

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_encoder.py   # H200 only (Gluon)

Checks every variant against the reference codec first (odd tiles, NaN / Inf / tiny / zero groups,
bf16; scales compared bit for bit, since the reference now divides with one rounding), then times
them alternately at 16M / 64M / 256M values (CUDA graphs, rotated inputs).
"""
import sys

import torch
import triton

from _probe import codec_table, encoder_reference_check, gpu_timings, persistent
from gluon_rows import compress_rows, compress_rows_ring
from gluon_words import compress_rows_rare, compress_words, compress_words_ring, words_operands
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk
from taco_accel.codec.reference import TINY_AMAX

if not torch.cuda.is_available():
    sys.exit("run11_encoder.py needs a GPU: Gluon kernels do not run in the interpreter")
dev = torch.device("cuda")
cfg = TacoConfig(backend="triton")
G = 128
COMMON = dict(G=G, QMAX=448.0, TINY=TINY_AMAX)


def _out(buf):
    return buf.view(torch.float8_e4m3fn), buf.view(torch.float32)


def rows(kern, nw=1):
    def run(x, buf, lay):
        kern[(triton.cdiv(lay.groups_per_chunk, 32 * nw),)](
            x, *_out(buf), lay.numel, lay.groups_per_chunk, NW=nw, X_BYTES=2, chunk_bytes=lay.chunk_bytes,
            PAD=lay.chunk_bytes - lay.used_bytes, num_warps=nw, **COMMON)
    return run


def words(rare, smem, nw=1):
    def run(x, buf, lay):
        args, named = words_operands(x, buf, lay)
        compress_words[(triton.cdiv(lay.groups_per_chunk, 32 * nw),)](
            *args, **named, NW=nw, RARE_BAD=rare, SMEM=smem, num_warps=nw)
    return run


def ring_words(smem, maxnreg=None):
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

    def run(x, buf, lay):
        args, named = words_operands(x, buf, lay)
        persistent(compress_words_ring, triton.cdiv(lay.groups_per_chunk, 32), 1, args,
                   dict(named, NW=1, STAGES=2, RARE_BAD=True, SMEM=smem, **extra))
    return run


def ring_rows(maxnreg):
    def run(x, buf, lay):
        persistent(compress_rows_ring, triton.cdiv(lay.groups_per_chunk, 32), 1,
                   (x, *_out(buf), lay.numel, lay.groups_per_chunk),
                   dict(COMMON, NW=1, X_BYTES=2, chunk_bytes=lay.chunk_bytes, PAD=lay.chunk_bytes - lay.used_bytes,
                        STAGES=2, maxnreg=maxnreg))
    return run


COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
        "rows": rows(compress_rows),
        "rows rare": rows(compress_rows_rare),
        "words rare": words(True, False),
        "words smem": words(False, True),
        "words rare smem": words(True, True),
        "ring rows 168": ring_rows(168),
        "ring words": ring_words(True),
        "ring words 168": ring_words(True, 168)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out)}

encoder_reference_check(cfg, COMP)
codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
