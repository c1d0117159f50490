"""Layer 1: the TACO FP8 codec (pure tensor code, no torch.distributed).

`compress` / `decompress` a tensor to and from one uint8 wire buffer (`layout`), `sum_packed`
for the reduce step of the two-shot all-reduce, and `calibrate` to pick a group size from data.
`CodecConfig` holds the codec's settings; `TacoConfig` adds the collectives' policy (an opt-in size
floor, pieces) for the layers above.
`dispatch` picks the implementation (`kernels/`: the PyTorch reference, Triton and Gluon
kernels) per call; `Tuning` holds the kernels' launch settings.
"""

from .api import GroupOverflowError, NonFiniteError, Packed, WireFormatError, check_wire, compress, decompress, sum_packed
from .calibrate import calibrate, relative_rms_error
from .config import CodecConfig, TacoConfig
from .layout import WireLayout
from .tuning import Launch, Tuning

__all__ = [
    "CodecConfig",
    "GroupOverflowError",
    "Launch",
    "NonFiniteError",
    "Packed",
    "TacoConfig",
    "Tuning",
    "WireFormatError",
    "WireLayout",
    "calibrate",
    "check_wire",
    "compress",
    "decompress",
    "relative_rms_error",
    "sum_packed",
]
