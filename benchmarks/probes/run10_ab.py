"""Run 10: the probe's Gluon decoder against the library's at 16M and 64M values, G = 128, bf16.

    PYTHONPATH=. python benchmarks/probes/run10_ab.py   # GPU

"probe": `gluon_rows.decompress_rows`; "library": `triton_kernels.decompress_into` (the Gluon
decoder of `gluon_kernels`); "kernel direct": that kernel launched without the Python wrapper;
"tensor core": the `triton_kernels` decoder. First run with the library kernel dividing the tile
index by the tiles per chunk and 64-bit chunk offsets: 0.834 against the probe's 0.879 at 16M,
the wrapper not the cause; fixed by 32-bit offsets without chunk terms for one chunk (RESULTS.md,
tenth run). The committed kernel was not timed here again: its outputs are checked equal.
"""
import torch
import triton

from _probe import decoder_rows, gpu_timings, library_decoder
from gluon_rows import decompress_rows
from taco_accel.codec import TacoConfig
from taco_accel.codec import gluon_kernels as gk
from taco_accel.codec.hadamard import device_signs

dev = torch.device("cuda")
cfg = TacoConfig(backend="triton")


def probe(buf, lay, out):
    decompress_rows[(triton.cdiv(lay.groups_per_chunk, 32),)](
        buf.view(torch.float8_e4m3fn), buf.view(torch.float32), out, lay.numel, lay.groups_per_chunk,
        G=128, NW=1, OUT_BYTES=2, num_warps=1)


signs = device_signs(cfg, dev)


def kernel_direct(buf, lay, out):  # the library's kernel without its Python wrapper
    gk._decompress_rows_kernel[(triton.cdiv(lay.groups_per_chunk, 32), 1)](
        buf.view(torch.float8_e4m3fn), buf.view(torch.float32), out, signs, lay.numel, lay.groups_per_chunk,
        lay.chunk_bytes, G=128, NW=1, Q_BYTES=1, OUT_BYTES=2, HADAMARD=True, SIGNS=False, DUAL=False,
        CHUNKED=False, WIDE=False, num_warps=1)


dec = {"probe": probe, "library": library_decoder(cfg), "kernel direct": kernel_direct,
       "tensor core": library_decoder(cfg, 0)}


def same_output(outs):
    assert torch.equal(outs["probe"], outs["library"]) and torch.equal(outs["probe"], outs["kernel direct"])


timings = gpu_timings(rounds=3)
for n in (16, 64):
    decoder_rows(timings, "", n, cfg, dec, check=same_output)
    torch.cuda.empty_cache()
timings.table(list(dec))
