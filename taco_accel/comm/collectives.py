"""Compressed collectives over torch.distributed process groups (skeleton: plain path only)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec import TacoConfig


def all_reduce(x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group``: a new tensor of x's shape and dtype."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def reduce_scatter(x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None) -> torch.Tensor:
    """x has P*m rows along dim 0; returns this rank's m rows of the sum over ranks."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by the group size {world}")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_gather(x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None) -> torch.Tensor:
    """Concatenation of every rank's ``x`` along dim 0, in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out
