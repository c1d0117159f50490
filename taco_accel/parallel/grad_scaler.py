"""fp16 loss scaling on a mesh: every rank skips the same steps.

``torch.amp.GradScaler`` decides per process: it unscales the gradients it holds, and skips the
optimizer step (and backs off the scale) if one of them is inf or NaN. With tensor, pipeline or
FSDP sharding each rank holds different gradients, so one rank's shard can overflow while its
peers' do not; a plain scaler would then skip the step on that rank only and the replicas of
the model drift apart (and their scales too). `MeshGradScaler` takes the MAX of the overflow
flag over the whole mesh after each unscale, so every rank sees the overflow of any rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MeshGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose found-inf flag is MAX-reduced over ``process_group``
    (default: every process, i.e. the whole tp x pp x dp mesh) at each unscale."""

    def __init__(self, device: str = "cuda", *, process_group=None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.process_group = process_group

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
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        for value in per_device.values():
            value.copy_(flag)
        return per_device or {flag.device: flag}
