"""Tensor-parallel layers: column / row parallel linear and the vocab-parallel embedding.

Drop-in for the transformers modules they replace: same parameter names (``weight``,
``bias``), full ``in_features`` / ``out_features`` (and ``local_*`` for this rank's part),
one tensor out, the tp degree in the repr. GPT-2's ``Conv1D`` keeps its [in, out] weight
layout (``conv1d=True``) so that state dict slices stay slices of the transformers tensors.
``shards`` maps a parameter name to its `ShardSpec`; replicated parameters are absent.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.copies import SharesGroup
from ..comm.dist_ops import group_rank, group_size
from .mappings import gather_from_tp_region, sum_replica_grads
from .overlap import RowSequenceLinear
from .regions import RegionEntry, RegionExit
from .shards import ShardSpec, linear_layout
from .sites import Site


def _init_uniform(tensor: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default init, with the fan-in of the full (unsharded) layer."""
    if tensor is not None and tensor.device.type != "meta":
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(tensor, -bound, bound)


class _ParallelLinear(SharesGroup, nn.Module):
    def __init__(self, in_features, out_features, bias, group, shard, conv1d, device, dtype):
        super().__init__()
        self.in_features, self.out_features, self.conv1d = in_features, out_features, conv1d
        self.group, self.tp, self.rank = group, group_size(group), group_rank(group)
        self.shard = shard
        self.local_in_features, self.local_out_features = in_features, out_features
        if shard.dim == int(conv1d):  # the output dim of the weight layout: column parallel
            self.local_out_features = shard.size(self.rank)
        else:
            self.local_in_features = shard.size(self.rank)
        shape = (self.local_in_features, self.local_out_features)
        self.weight = nn.Parameter(torch.empty(shape if conv1d else shape[::-1], device=device, dtype=dtype))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.local_out_features, device=device, dtype=dtype))
        _init_uniform(self.weight, in_features)
        _init_uniform(self.bias, in_features)

    @classmethod
    def from_module(cls, module: nn.Module, *, shard: ShardSpec | None = None, **kwargs):
        """This rank's part of an existing ``nn.Linear`` / ``Conv1D`` (parameters copied)."""
        in_features, out_features, conv1d = linear_layout(module)
        new = cls(
            in_features, out_features, module.bias is not None, shard=shard, conv1d=conv1d,
            device="meta", dtype=module.weight.dtype, **kwargs,
        )
        for name, param in module.named_parameters(recurse=False):
            spec = new.shards.get(name)
            value = param.detach() if spec is None else spec.take(param.detach(), new.rank)
            setattr(new, name, nn.Parameter(value, requires_grad=param.requires_grad))
        return new

    def _local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight.t() if self.conv1d else weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local=({self.local_in_features}, {self.local_out_features}), "
            f"bias={self.bias is not None}, tp={self.tp}" + (", conv1d" if self.conv1d else "")
        )


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A with A split by output features: this rank computes ``local_out_features``.

    Megatron's column-parallel linear. ``entry`` enters the TP region (f, or the sequence
    all-gather: a `RegionEntry`, or an `overlap.ColumnRegion` holding this layer, which also
    computes its output and overlaps its backward); leave it ``None`` when the caller enters
    once for several layers that read the same input (q/k/v). `gather_outputs` concatenates
    the outputs of all ranks (the lm head's full logits) through the plain site ``gather``.
    ``shard`` defaults
    to an even split; pass `ShardSpec.heads` / `ShardSpec.concat` for attention projections.
    Blocks held by several ranks (replicated kv heads) get their gradients summed at ``replica_site``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, group=None,
        shard: ShardSpec | None = None, conv1d: bool = False, entry: RegionEntry | None = None,
        gather: Site | None = None, replica_site: Site | None = None, device=None, dtype=None,
    ) -> None:
        shard = shard or ShardSpec.even(out_features, group_size(group), what="out_features")
        shard = shard.on_dim(1 if conv1d else 0)
        super().__init__(in_features, out_features, bias, group, shard, conv1d, device, dtype)
        self.shards = {"weight": shard, "bias": shard.on_dim(0)}
        self.entry, self.gather = entry, gather
        self.gather_sizes = [shard.size(r) for r in range(self.tp)]  # every rank's output width
        if shard.replicas > 1 and replica_site is None:
            raise ValueError("a shard with replicated blocks needs replica_site to sum their gradients")
        self.replica_site = replica_site
        self.ready: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, output) from an overlap.ColumnRegion

    def region_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as this layer multiplies with them (replicated blocks sum their gradients)."""
        weight, bias = self.weight, self.bias
        if self.shard.replicas > 1:
            weight = sum_replica_grads(weight, self.shards["weight"], self.replica_site)
            bias = None if bias is None else sum_replica_grads(bias, self.shards["bias"], self.replica_site)
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            x = self.entry(x)  # (b, s, in), the same on every rank
        ready, self.ready = self.ready, None
        if ready is not None and ready[0] is x:
            out = ready[1]  # computed by the region with its backward overlap (tp.overlap)
        else:
            out = self._local_linear(x, *self.region_params())  # (b, s, out/tp)
        return out

    def gather_outputs(self, out: torch.Tensor) -> torch.Tensor:
        """Every rank's ``out`` (b, s, out/tp) concatenated in rank order, (b, s, out), at the site
        ``gather``; differentiable (backward: this rank's slice of the gradient)."""
        return gather_from_tp_region(out, self.gather, -1, self.gather_sizes)


class RowParallelLinear(_ParallelLinear):
    """Y = X A with A split by input features: this rank multiplies its ``local_in_features``.

    Megatron's row-parallel linear. The local product is a partial sum; ``reduce`` (a
    `RegionExit`: g, or the sequence reduce-scatter) adds the partial sums of all ranks, then
    the (replicated) bias is added once. ``partial`` and ``reduce`` are separate steps so that
    LoRA or an emulation can add to or replace the reduction.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, group=None,
        shard: ShardSpec | None = None, conv1d: bool = False, reduce: RegionExit, device=None, dtype=None,
    ) -> None:
        shard = shard or ShardSpec.even(in_features, group_size(group), what="in_features")
        shard = shard.on_dim(0 if conv1d else 1)
        super().__init__(in_features, out_features, bias, group, shard, conv1d, device, dtype)
        self.shards = {"weight": shard}
        self.reduce = reduce

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, (b, s, in/tp) -> (b, s, out), no bias."""
        return self._local_linear(x, self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.reduce, RegionExit) and self.reduce.sequence_overlap():
            out = RowSequenceLinear.apply(x, self.weight, self.conv1d, self.reduce)  # (b, s/tp, out)
        else:
            out = self.reduce(self.partial(x))  # (b, s, out), or (b, s/tp, out) sequence parallel
        return out if self.bias is None else out + self.bias.to(out.dtype)  # bf16 under autocast, as nn.Linear's


class VocabParallelEmbedding(SharesGroup, nn.Module):
    """An embedding table split by vocabulary rows (sizes may differ by one between ranks).

    Each rank looks up the ids in its rows and writes zeros for the others; ``reduce`` (g)
    sums the ranks. ``num_embeddings`` and ``padding_idx`` are those of the full table.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *, group=None,
        reduce: RegionExit, device=None, dtype=None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        if num_embeddings < tp:
            raise ValueError(f"a vocabulary of {num_embeddings} cannot be split over tp={tp} ranks")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.group, self.tp, self.rank, self.reduce = group, tp, rank, reduce
        self.shard = ShardSpec.balanced(num_embeddings, tp)
        self.shards = {"weight": self.shard}
        ((self.vocab_start, self.vocab_end),) = self.shard.ranges[rank]
        self.local_padding_idx = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            self.local_padding_idx = padding_idx - self.vocab_start
        rows = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)

    @classmethod
    def from_module(cls, module: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        new = cls(
            module.num_embeddings, module.embedding_dim, module.padding_idx,
            device="meta", dtype=module.weight.dtype, **kwargs,
        )
        weight = new.shard.take(module.weight.detach(), new.rank)
        new.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        return new

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # (b, s, h), this rank's rows
        return self.reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end}), "
            f"padding_idx={self.padding_idx}, tp={self.tp}"
        )
