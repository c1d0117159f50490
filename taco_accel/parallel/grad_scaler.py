"""fp16 loss scaling on a mesh: every rank skips the same steps.

``torch.amp.GradScaler`` decides per process: it unscales the gradients it holds, and skips the
optimizer step (and backs off the scale) if one of them is inf or NaN. With tensor, pipeline or
FSDP sharding each rank holds different gradients, so one rank's shard can overflow while its
peers' do not; a plain scaler would then skip the step on that rank only and the replicas of
the model drift apart (and their scales too). `MeshGradScaler` takes the MAX of the overflow
flag over the whole mesh after each unscale, so every rank sees the overflow of any rank.

The same all-reduce carries the step's wire-header flags (``wire_check``: a `comm.stats.WireCheck`
of the model's sites), so that a chunk read as NaN raises a `WireFormatError` at the optimizer
step instead of being skipped as an overflow step after step: the scaler's own read of its
overflow flag is the step's one host read; a skipped step reads the reduced flag once more to
tell the two apart (`settle_wire`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class MeshGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose found-inf flag is MAX-reduced over ``process_group``
    (default: every process, i.e. the whole tp x pp x dp mesh) at each unscale."""

    WIRE = 2.0  # the reduced flag's value for a wire error (an overflow is 1)

    def __init__(self, device: str = "cuda", *, process_group=None, wire_check: Callable | None = None,
                 **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group
        self.wire_check = wire_check  # -> a WireCheck of the step's collectives, or None
        self._wire = None  # (the WireCheck, the reduced flag) of this step's unscale

    # torch 2.13's GradScaler funnels every unscale through the private `_unscale_grads_` (from
    # `unscale_`, from `step` when not unscaled yet, and from `_check_inf_per_device` for
    # optimizers that scale themselves); it returns {device: found_inf}, which `step` and
    # `update` read. This override is the only use of a private name of GradScaler here.
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not dist.is_initialized() or dist.get_world_size(self.process_group) == 1:
            return per_device
        # one flag for this rank (a rank without gradients still takes part in the collective)
        flag = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for value in per_device.values():
            flag += value.to(flag.device)
        check = self.wire_check() if self.wire_check is not None else None
        if check is not None:
            flag = torch.maximum(flag.clamp(max=1), check.flag.to(flag.device) * self.WIRE)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        if check is not None:
            self._wire = (check, flag)
            flag = flag.clamp(max=1)  # what the overflow logic reads: nonzero skips the step
        for value in per_device.values():
            value.copy_(flag)
        return per_device or {flag.device: flag}

    def settle_wire(self, skipped: bool) -> None:
        """After the optimizer step this unscale served: a `WireFormatError` on every rank if a
        chunk of the step's collectives had another header on any rank (the step was skipped
        then; only a skipped step reads the reduced flag again), else the flags marked read."""
        if self._wire is None:
            return
        (check, flag), self._wire = self._wire, None
        check.settle(skipped and float(flag) >= self.WIRE)
