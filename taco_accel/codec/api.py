"""Public entry points of the codec: `compress`, `decompress`, `sum_packed`.

Each takes ``tuning=`` (a `Tuning`; default ``Tuning()``) for the kernels' launch settings, and
hands the work to `dispatch`, which picks the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dispatch
from .config import TacoConfig
from .layout import WireLayout
from .tuning import DEFAULT_TUNING, Tuning

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NonFiniteError(FloatingPointError):
    """A tensor holding NaN or Inf reached the codec under ``nonfinite="raise"``."""


@dataclass(frozen=True)
class Packed:
    """A compressed tensor: the wire ``buffer`` plus what is needed to decode it.

    ``buffer`` is one contiguous 1-D uint8 tensor laid out as `layout.WireLayout` describes;
    ``shape`` and ``dtype`` are those of the original tensor.
    """

    buffer: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    config: TacoConfig
    layout: WireLayout

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"compress expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"compress supports {SUPPORTED_DTYPES}, got {x.dtype}; cast the tensor first")


def _raise_if_nonfinite(scales: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError(
            f"{what} holds NaN or Inf (TacoConfig.nonfinite='raise'); find where the run "
            "diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
        )


def compress(x: torch.Tensor, config: TacoConfig | None = None, *, chunks: int = 1,
             tuning: Tuning | None = None) -> Packed:
    """Encode ``x`` (fp32 / fp16 / bf16, any shape, any numel) into one wire buffer.

    ``chunks`` > 1 cuts the buffer into that many equal chunks of whole groups (the unit the
    two-shot all-reduce sends to each rank).
    """
    _check_input(x)
    config = config or TacoConfig()
    layout = WireLayout.for_tensor(x.numel(), config, chunks)
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=x.device)
    if layout.numel:
        dispatch.compress_into(x.reshape(-1), buffer, layout, config, tuning or DEFAULT_TUNING)
        if config.nonfinite == "raise":
            _raise_if_nonfinite(layout.scales(buffer), "the tensor to compress")
    return Packed(buffer, x.shape, x.dtype, config, layout)


def decompress(packed: Packed, out: torch.Tensor | None = None, *, tuning: Tuning | None = None) -> torch.Tensor:
    """Decode ``packed`` to a tensor of its original shape, dtype and device (or into ``out``)."""
    if packed.buffer.dim() != 1 or packed.buffer.numel() != packed.layout.total_bytes:
        raise ValueError(
            f"packed.buffer has {packed.buffer.numel()} bytes but its layout needs "
            f"{packed.layout.total_bytes}: the buffer does not belong to this layout"
        )
    if out is None:
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
    elif out.numel() != packed.layout.numel or not out.is_contiguous() or out.device != packed.device:
        raise ValueError(f"out must be a contiguous tensor of {packed.layout.numel} elements on {packed.device}")
    if packed.layout.numel:
        dispatch.decompress_into(packed.buffer, packed.layout, packed.config, out.view(-1), tuning or DEFAULT_TUNING)
    return out


def sum_packed(stacked: torch.Tensor, layout: WireLayout, config: TacoConfig, *,
               tuning: Tuning | None = None) -> torch.Tensor:
    """The reduce step of the two-shot all-reduce: dequantise, sum in fp32 and requantise.

    ``stacked`` is [P, layout.total_bytes] uint8 (P buffers of one layout, e.g. the chunk
    every peer sent to this rank); returns one buffer of that layout holding their sum, still
    in the transformed domain (no inverse transform is needed).
    """
    if stacked.dim() != 2 or stacked.shape[1] != layout.total_bytes or stacked.dtype != torch.uint8:
        raise ValueError(
            f"sum_packed expects uint8 [P, {layout.total_bytes}], got {stacked.dtype} {list(stacked.shape)}"
        )
    out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=stacked.device)
    if layout.numel:
        dispatch.sum_into(stacked, layout, config, out, tuning or DEFAULT_TUNING)
    return out
