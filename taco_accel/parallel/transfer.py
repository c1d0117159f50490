"""What the host holds, put on the device without making the host wait.

A copy from pageable host memory to a CUDA device synchronises the stream (torch waits for the
copy before it returns), so a training step that moves its batch with ``.to(device)`` and its
host-side figures with ``torch.tensor(values, device=...)`` stops the host once per tensor.
From pinned memory the copy is asynchronous (``non_blocking``): the step's only wait is then its
one read of the results. On other devices these are plain ``.to(device)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor: a batch's ids or labels) on ``device``, copied from pinned memory
    without a host sync on CUDA."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def host_numbers(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``values`` (numbers the host holds, e.g. the bytes a step's collectives sent) as a 1-d
    tensor on ``device``, copied without a host sync: to be reduced and read with a step's
    device figures."""
    return to_device(torch.tensor(values, dtype=dtype), device)


__all__ = ["host_numbers", "to_device"]
