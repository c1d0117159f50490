"""Mixed precision of a `taco_accel.Accelerator` over its mesh.

- `mesh_scaler`: fp16 gets a `MeshGradScaler` on every device type. Accelerate leaves fp16 off
  on CPU (no autocast, no scaler), and its scaler decides per process, which would let one rank
  skip a step its tp / pp / dp peers take; the mesh's scaler skips on every rank at once.
- `check_precision`: the precisions that would fail mid-step, refused when a model is prepared.
- `fsdp_param_dtype`: FSDP2's parameter dtype under ``mixed_precision="bf16"``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import ParallelDims
from ..parallel.grad_scaler import MeshGradScaler


def mesh_scaler(mixed_precision: str, scaler_handler, device_type: str) -> MeshGradScaler | None:
    """The gradient scaler of an Accelerator in ``mixed_precision`` (None but for fp16), with the
    settings of its ``GradScalerKwargs`` handler (``scaler_handler``, or None) if any."""
    if mixed_precision != "fp16":
        return None
    kwargs = scaler_handler.to_kwargs() if scaler_handler is not None else {}
    return MeshGradScaler(device_type, **kwargs)


def check_precision(mixed_precision: str, model: nn.Module, pipeline: bool) -> None:
    """A ValueError naming the fix for fp16 with pipeline stages (the schedule's backward has no
    loss scaling) or with float16 trainable parameters (the scaler cannot unscale them)."""
    if mixed_precision != "fp16":
        return
    if pipeline:
        raise ValueError("mixed_precision='fp16' is not supported with pipeline stages (the schedule's backward "
                         "has no loss scaling); use mixed_precision='bf16'")
    half = sorted({n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16})
    if half:
        raise ValueError(f"mixed_precision='fp16' needs fp32 trainable parameters, {len(half)} are float16 (e.g. "
                         f"{half[0]}): the gradient scaler cannot unscale fp16 gradients; load the model in "
                         "float32 (dtype=torch.float32) or use mixed_precision='bf16'")


def fsdp_param_dtype(dims: ParallelDims, mixed_precision: str) -> torch.dtype | None:
    """FSDP2's compute dtype (`distribute`'s ``param_dtype``): bf16 for FSDP2 over more than one dp
    rank under ``mixed_precision="bf16"`` (gradients still reduced in fp32), else None (the
    parameters' own)."""
    fsdp = dims.dp_mode == "fsdp" and dims.dp > 1
    return torch.bfloat16 if fsdp and mixed_precision == "bf16" else None
