"""`Tuning`: how the fused kernels are launched, as one frozen value passed down from the calls.

``compress``, ``decompress`` and ``sum_packed`` take ``tuning=`` (default: ``Tuning()``, the
settings below) and hand it down to `dispatch` and the kernel launchers; nothing reads a module
global, so a benchmark times a variant by passing its own value (``Tuning().replace(...)``).

No setting changes what a tensor decodes to beyond fp32 rounding: they choose launch shapes,
the operand types of the tensor-core products, and which of the equivalent kernels codes a
group size (`dispatch` has the table). The defaults are the fastest of the variants that
``python -m taco_accel.bench.codec`` sweeps, on a GPU with bf16 input (benchmarks/RESULTS.md has
the figures and the machine).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

STEPS = ("compress", "decompress", "sum_pair", "sum", "sum_many")


class DotMode(enum.IntEnum):
    """Operand types of the tensor-core products with the +-1 Hadamard matrix (exact in each)."""

    FP32 = 0  # fp32 operands: the interpreter, whose bf16 products are wrong
    TF32 = 1  # tf32 (10 mantissa bits of the input)
    BF16X2 = 2  # two bf16 products, high and low halves: about 16 mantissa bits
    BF16 = 3  # one bf16 product: for operands exact in bf16 (bf16 input)
    PAYLOAD = 4  # the payload's own type, fp8 or int8 (decoding: no conversion before the product)


class Store(enum.IntEnum):
    """How the tensor-core decoder stores decoded values."""

    PLAIN = 0
    STREAM = 1  # evict-first (``.cs``): skips the L2 cache, which the next op would read from


@dataclass(frozen=True)
class Launch:
    """Launch settings of one step of the tensor-core kernels.

    ``num_warps`` for a tile of `Tuning.block_elems` values; ``num_stages``: tiles in flight per
    program; ``programs_per_sm``: persistent programs per SM (None: as many as fit at once, 0:
    one program per tile instead of a persistent grid).
    """

    num_warps: int
    num_stages: int
    programs_per_sm: int | None = None


@dataclass(frozen=True)
class Tuning:
    """Launch settings of every kernel (see the module docstring).

    Tensor-core kernels (`kernels.triton_kernels`), per step (``compress``, ``decompress``, and
    the sum of 2 inputs ``sum_pair``, of 3-4 ``sum``, of more ``sum_many``), a `Launch`; and:

    - ``block_elems``: values per tile (tiles hold whole groups, at least 64 of them when
      transforming: one Hopper warpgroup product's rows).
    - ``dot_mode``: `DotMode` of the encoder's products for fp32 / fp16 input (bf16 input takes
      one bf16 product, which is exact for it).
    - ``payload_dot``: decode with products on the payload's own type (fp8 / int8).
    - ``balance``: as many programs as give each the same number of tiles.
    - ``stores``: `Store` of the decoder.

    One-group-per-lane kernels (`kernels.gluon_kernels`, NVIDIA GPUs):

    - ``rows_max_group``: the largest G they code (0: never; they cannot hold more than 128).
    - ``rows_warps``: warps per program (32 groups each); independent one-warp programs keep the
      most loads in flight.
    - ``rows_compress_registers`` / ``rows_decompress_registers``: register cap per thread
      (None: the compiler's choice; fewer registers fit more warps on an SM).
    - ``split_max_groups``: up to this many groups of 128 (all chunks counted) the encoder
      splits each group over lanes (`kernels.gluon_kernels.split_schedule`): at these sizes a
      kernel lasts only a few waves, and its first and last programs, whose tiles are the only
      ones in flight, are bound by the instructions their warps issue; past it, one lane a group
      issues fewer instructions in all.
    - ``split_head_waves`` / ``split_tail_waves``: the share of a wave of programs at the
      kernel's start / end whose groups go over 4 lanes instead of 2.
    - ``split_warps_per_sm``: the 2-lane programs one SM holds at ``split_registers``
      registers a thread (the 2-lane code's own count: it sets how many programs form a wave).
    """

    block_elems: int = 8192
    compress: Launch = Launch(num_warps=4, num_stages=3)
    decompress: Launch = Launch(num_warps=8, num_stages=3, programs_per_sm=2)
    sum_pair: Launch = Launch(num_warps=8, num_stages=1)
    sum: Launch = Launch(num_warps=4, num_stages=2)
    sum_many: Launch = Launch(num_warps=8, num_stages=2)
    dot_mode: DotMode = DotMode.BF16X2
    payload_dot: bool = True
    balance: bool = False
    stores: Store = Store.PLAIN
    rows_max_group: int = 128
    rows_warps: int = 1
    rows_compress_registers: int | None = None
    rows_decompress_registers: int | None = None
    split_max_groups: int = 6 * 2**16
    split_head_waves: float = 0.25
    split_tail_waves: float = 0.5
    split_warps_per_sm: float = 25
    split_registers: int = 80

    def launch(self, step: str) -> Launch:
        """The `Launch` of ``step`` (one of `STEPS`)."""
        if step not in STEPS:
            raise ValueError(f"unknown kernel step {step!r}; use one of {STEPS}")
        return getattr(self, step)

    def replace(self, **changes) -> "Tuning":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


DEFAULT_TUNING = Tuning()
