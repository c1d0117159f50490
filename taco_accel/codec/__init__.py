"""Layer 1: the TACO FP8 codec (pure tensor code, no torch.distributed).

`compress` / `decompress` a tensor to and from one uint8 wire buffer, `sum_packed` for the
reduce step of the two-shot all-reduce, and `calibrate` to pick a group size from data.
"""

from .api import NonFiniteError, Packed, backend_for, compress, decompress, sum_packed
from .calibrate import calibrate, relative_rms_error
from .config import TacoConfig
from .layout import WireLayout

__all__ = [
    "NonFiniteError",
    "Packed",
    "TacoConfig",
    "WireLayout",
    "backend_for",
    "calibrate",
    "compress",
    "decompress",
    "relative_rms_error",
    "sum_packed",
]
