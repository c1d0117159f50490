"""Run 11: a persistent encoder whose next tiles arrive as bulk (TMA) copies requested by one lane
(`gluon_words.compress_words_tma`, 2 or 3 tiles in flight), against the library's encoder.

    cd benchmarks/probes && PYTHONPATH=../..:. python run11_tma.py   # GPU (Hopper)

The tenth run's ring of cp.async copies reached 0.83 at 16M, the best there, and lost at 64M and
256M; its per-lane address arithmetic took about 250 instructions a tile. Here one lane asks for
each tile. Whole groups only (the input viewed as [groups, 64] int32).
"""
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from _probe import codec_table, encoder_reference_check, gpu_timings, persistent
from gluon_words import compress_words_tma
from taco_accel.codec import TacoConfig
from taco_accel.codec import triton_kernels as tk
from taco_accel.codec.reference import TINY_AMAX

cfg = TacoConfig(backend="triton")
SWIZZLED = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def tma(stages):
    def run(x, buf, lay):
        assert lay.numel % 128 == 0 and lay.chunks == 1
        desc = TensorDescriptor.from_tensor(x.view(torch.int32).view(-1, 64), [32, 32], SWIZZLED)
        persistent(compress_words_tma, lay.groups_per_chunk // 32, 1,
                   (desc, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), lay.groups_per_chunk),
                   dict(G=128, QMAX=448.0, TINY=TINY_AMAX, chunk_bytes=lay.chunk_bytes,
                        PAD=lay.chunk_bytes - lay.used_bytes, STAGES=stages))
    return run


COMP = {"base": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg), "tma 2": tma(2), "tma 3": tma(3)}
DEC = {"base": lambda buf, lay, out: tk.decompress_into(buf, lay, cfg, out)}
assert torch.cuda.is_available()
encoder_reference_check(cfg, COMP, sizes=(128 * 1024, 128 * 12352))
codec_table(gpu_timings(rounds=3), cfg, COMP, DEC)
