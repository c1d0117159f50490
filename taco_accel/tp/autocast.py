"""Autocast inside the TP layers' custom autograd functions.

``nn.Linear`` under autocast casts its input, weight and bias to the autocast dtype (bf16,
fp16), multiplies in that dtype, and its backward, through the casts' own backward, returns
each gradient in its tensor's dtype. A custom ``autograd.Function`` gets the first half for
free (its forward runs under autocast, so ``F.linear`` casts), but its backward runs outside
autocast: a bf16 output gradient times a saved fp32 weight raises. `MatmulCast` makes the
casts explicit: the forward casts each operand once (and saves the casts for backward, as the
cast ops of ``nn.Linear`` do), the backward multiplies in the same dtype and returns every
gradient in its input's dtype (`grad_for`), so that what follows (the input gradient's
collective, the optimizer) sees the dtypes of the unparallelised model under the same autocast.
"""

from __future__ import annotations

import torch


class MatmulCast:
    """The autocast state where it is built (``device_type`` of the tensors multiplied):
    ``dtype`` the dtype the matmuls run in, or None (autocast off: no cast)."""

    def __init__(self, device_type: str) -> None:
        enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type) if enabled else None

    def __call__(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` in the matmul dtype; as is when autocast is off, for None, and for what autocast
        leaves alone (float64, integer tensors)."""
        return t.to(self.dtype) if t is not None and self.changes(t) else t

    def changes(self, t: torch.Tensor) -> bool:
        """Whether ``self(t)`` is a cast (a new tensor), decided from dtypes alone: no cast is made."""
        return self.dtype is not None and t.is_floating_point() and t.dtype not in (torch.float64, self.dtype)

    @staticmethod
    def grad_for(grad: torch.Tensor | None, like: torch.Tensor | torch.dtype) -> torch.Tensor | None:
        """``grad`` in the dtype of the tensor it is the gradient of (``like``, or that dtype)."""
        dtype = like if isinstance(like, torch.dtype) else like.dtype
        return grad if grad is None or grad.dtype == dtype else grad.to(dtype)
