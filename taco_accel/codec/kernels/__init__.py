"""The codec's implementations, side by side; `..dispatch` picks one per call.

- `reference`: plain PyTorch, the specification of the algorithm and the path on the CPU;
- `triton_kernels`: fused Triton kernels on tiles of groups, the transform on the tensor cores
  (any group size, any GPU Triton supports, and the CPU under ``TRITON_INTERPRET=1``);
- `gluon_kernels`: compress and decompress with one group per lane (G <= 128, NVIDIA GPUs).

Each module implements the same contract (``compress_into``, ``decompress_into``, ``sum_into``
where it has them) on the byte layout of `..layout`, and encodes the same bytes up to the
rounding of values at a tie. This package imports only torch: the Triton modules are imported
when `..dispatch` chooses them.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count
