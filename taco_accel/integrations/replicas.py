"""Accelerate's evaluation collectives over the data-parallel replicas of a mesh (its ``"dp"``
DeviceMesh, one process per replica): the tensor- and pipeline-parallel ranks of a replica hold
the same batches, so each sample counts once. What `taco_accel.Accelerator`'s ``gather``,
``gather_for_metrics`` and ``reduce`` do (and, for TRL's online trainers, Accelerate's module-level
``gather_object``); each is a collective over the replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils.operations import recursively_apply

REDUCTIONS = ("sum", "mean", "none")


def gather(tensor, dp):
    """``tensor`` (or a nested structure of tensors) concatenated over the replicas along dim 0
    (a 0-d tensor as one row per replica)."""
    if dp.size() == 1:
        return tensor
    group, size = dp.get_group(), dp.size()

    def one(t: torch.Tensor) -> torch.Tensor:
        t = (t.clone()[None] if t.ndim == 0 else t).contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)

    return recursively_apply(one, tensor, error_on_other_type=True)


def gather_object(objects: list, dp) -> list:
    """The items of ``objects`` (a list) of every replica, in replica order."""
    if dp.size() == 1:
        return list(objects)
    parts = [None] * dp.size()
    dist.all_gather_object(parts, objects, group=dp.get_group())
    return [x for part in parts for x in part]


def gather_for_metrics(input_data, dp, gradient_state, use_gather_object: bool = False):
    """`gather` (an object gather for anything but tensors, or with ``use_gather_object``) without
    the samples the sharded DataLoader repeated to fill its last batch (Accelerate's
    ``gradient_state.remainder`` at the end of the DataLoader)."""
    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    use_gather_object = use_gather_object or not all_tensors
    if use_gather_object:
        data = gather_object(input_data, dp)
    else:
        data = gather(input_data, dp)
    remainder = gradient_state.remainder
    if not gradient_state.end_of_dataloader or remainder <= 0:
        return data
    if use_gather_object:
        return data[:remainder]
    return recursively_apply(lambda t: t[:remainder] if t.ndim else t, data)  # a scalar holds no samples


def reduce(tensor, dp, reduction: str = "sum"):
    """``tensor`` (or a nested structure of tensors) summed or averaged over the replicas
    (``reduction``: ``"sum"``, ``"mean"``, or ``"none"``: as it is)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use 'sum', 'mean' or 'none'")
    if reduction == "none" or dp.size() == 1:
        return tensor

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=dp.get_group())
        return out / dp.size() if reduction == "mean" else out

    return recursively_apply(one, tensor, error_on_other_type=True)
