"""`Compression` lives in `taco_accel.comm.policy` (it governs tp, pp and dp sites alike); this
name is kept so that ``from taco_accel.tp.compression import Compression`` keeps working."""

from ..comm.policy import DEFAULT_MODE, Compression, CompressionLike

__all__ = ["DEFAULT_MODE", "Compression", "CompressionLike"]
