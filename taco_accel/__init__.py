"""taco_accel: tensor-parallel training for Hugging Face models with FP8-compressed TP communication."""

from .codec import NonFiniteError, Packed, TacoConfig, calibrate, compress, decompress

__version__ = "0.1.0"

__all__ = [
    "NonFiniteError",
    "Packed",
    "TacoConfig",
    "calibrate",
    "compress",
    "decompress",
]
