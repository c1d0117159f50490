"""Tensor parallelism emulated in one process: tp virtual ranks with the numerics of real TP.

``taco_accel.parallelize(model, tp=8, emulate=True)`` swaps in these layers. Each keeps the
full (unsplit) transformers parameter and computes, for every virtual rank p, what rank p
computes in real TP: the same slice of the weight (contiguous, as real TP stores it) in a
matmul of the same shape. Whatever real ranks send each other goes through an
`EmulatedGroup` (``taco_accel.comm.emulated``), which makes the same codec calls on the same
bytes, per site, with the site's own settings and statistics. The per-rank tensors and what
the collectives return therefore equal those of a real run; only sums that real TP takes in
torch.distributed's order (plain collectives, gradients of replicated weights) can differ by
fp32 rounding.

Tensors that differ between ranks are lists indexed by rank; replicated tensors are single
tensors. A column-parallel output is every rank's local output concatenated in rank order,
segment by segment (GPT-2's fused q|k|v: all q parts, then all k parts, then all v parts).
That is the full output, except that a kv head replicated on several ranks appears once per
rank, so that each rank's query heads attend to (and send gradients to) their own kv copy,
exactly as on the real ranks.

    Megatron mapping          emulated forward                        backward
    f  (enter the region)     x -> tp views (each rank's copy)        all-reduce the tp partial grads
    g  (leave the region)     all-reduce the tp partials              the gradient to every rank
    SP enter                  all-gather the shards, then tp views    reduce-scatter the tp partial grads
    SP leave                  reduce-scatter the tp partials          all-gather the gradient shards
    SP split (first layer)    identity                                all-gather the gradient shards
    SP gather (final norm)    all-gather the shards                   identity (each rank keeps its part)

With sequence parallelism the residual stream stays whole in memory: the concatenation of the
ranks' blocks (`mappings`), which is the tensor itself, on which per-token work (norms,
residual adds) equals the ranks' work on their blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.emulated import EmulatedGroup
from .mappings import blocks
from .regions import SEQ_DIM, HiddenStatesHook, SequenceState
from .shards import ShardSpec, linear_layout
from .sites import Site

# --- collectives on per-rank lists, through one site -----------------------------------------


def _all_reduce(group: EmulatedGroup, xs: list[torch.Tensor], site: Site) -> torch.Tensor:
    return group.collective("all_reduce", torch.stack(xs), site)


def _all_gather_seq(group: EmulatedGroup, x: torch.Tensor, site: Site, dim: int) -> torch.Tensor:
    """Every rank's block of ``x`` through the all-gather; whole again (the blocks in rank order)."""
    stacked = x.contiguous().view(group.world, -1, x.shape[-1])  # (tp, b*s/tp, h): rank r's block at [r]
    return group.collective("all_gather", stacked, site).view(x.shape)


def _reduce_scatter_seq(group: EmulatedGroup, xs: list[torch.Tensor], site: Site, dim: int) -> torch.Tensor:
    """The sum of the tp partials through the reduce-scatter: every rank's block, whole again."""
    rows = torch.stack(xs).view(group.world, group.world, -1, xs[0].shape[-1])  # [rank, block, b*s/tp, h]
    return group.collective("reduce_scatter", rows, site).view(xs[0].shape)


# --- autograd functions -----------------------------------------------------------------------


class _FanOut(torch.autograd.Function):
    """f: forward tp views of x (one per rank), backward the tp partial gradients through the
    all-reduce (``dim=None``) or the reduce-scatter along ``dim`` (sequence parallel)."""

    @staticmethod
    def forward(ctx, x, group: EmulatedGroup, bwd: Site, dim: int | None):
        ctx.group, ctx.bwd, ctx.dim = group, bwd, dim
        return tuple(x.view_as(x) for _ in range(group.world))

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        if ctx.dim is None:
            return _all_reduce(ctx.group, grads, ctx.bwd), None, None, None
        return _reduce_scatter_seq(ctx.group, grads, ctx.bwd, ctx.dim), None, None, None


class _Reduce(torch.autograd.Function):
    """g: forward all-reduce of the tp partials, backward the gradient to every rank."""

    @staticmethod
    def forward(ctx, group: EmulatedGroup, fwd: Site, *partials):
        ctx.n = len(partials)
        return _all_reduce(group, list(partials), fwd)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *([grad] * ctx.n))


class _ReduceScatterSequence(torch.autograd.Function):
    """SP leave: forward reduce-scatter of the tp partials along ``dim``, backward all-gather of
    the gradient shards (every rank then holds the whole gradient)."""

    @staticmethod
    def forward(ctx, group: EmulatedGroup, fwd: Site, bwd: Site, dim: int, *partials):
        ctx.group, ctx.bwd, ctx.dim, ctx.n = group, bwd, dim, len(partials)
        return _reduce_scatter_seq(group, list(partials), fwd, dim)

    @staticmethod
    def backward(ctx, grad):
        whole = _all_gather_seq(ctx.group, grad, ctx.bwd, ctx.dim)
        return (None, None, None, None, *([whole] * ctx.n))


class _SplitSequence(torch.autograd.Function):
    """SP split: forward identity (each rank keeps its shard), backward all-gather of the
    gradient shards."""

    @staticmethod
    def forward(ctx, x, group: EmulatedGroup, bwd: Site, dim: int):
        ctx.group, ctx.bwd, ctx.dim = group, bwd, dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(ctx.group, grad, ctx.bwd, ctx.dim), None, None, None


class _GatherSequence(torch.autograd.Function):
    """SP gather: forward all-gather of the shards along ``dim``, backward identity (each rank
    keeps its part of the gradient, which every rank holds whole)."""

    @staticmethod
    def forward(ctx, x, group: EmulatedGroup, fwd: Site, dim: int):
        return _all_gather_seq(group, x, fwd, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class RankParts:
    """Every rank's part of a full tensor split by ``split`` (`ShardSpec.take`), with its gradient
    put together once in backward (`_RankParts`). What the parts need of the spec is read here,
    once, into plain attributes: the forward and backward then read no cached property (whose
    lock torch.compile cannot trace) and branch on nothing but constants of the layer.

    Plain slicing would make autograd build each part's gradient as a zero-filled tensor of the
    full size and add the tp of them up: tp fills, copies and additions of the whole tensor for
    every weight and every row-parallel input, each step."""

    __slots__ = ("split", "tp", "disjoint", "in_order")

    def __init__(self, split: ShardSpec) -> None:
        self.split, self.tp = split, split.tp
        self.disjoint, self.in_order = split.replicas == 1, split.in_order

    def __call__(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _RankParts.apply(full, self)

    def grad(self, grads: Sequence[torch.Tensor | None], shape: torch.Size) -> torch.Tensor | None:
        """The gradient of the full tensor from every rank's part's (None: that part unused)."""
        split = self.split
        if self.disjoint and None not in grads:
            if self.in_order:
                return torch.cat(list(grads), dim=split.dim)  # each written once, in order
            return split.assemble(grads)
        grad = None
        for p, g in enumerate(grads):  # replicated parts (kv heads) add up, in rank order
            if g is not None:
                grad = g.new_zeros(shape) if grad is None else grad
                split.place(g, p, grad, accumulate=True)
        return grad


class _RankParts(torch.autograd.Function):
    """`RankParts`: forward the parts (views where a part is one contiguous block), backward
    their gradients put together."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, parts: RankParts):
        ctx.parts, ctx.shape = parts, full.shape
        return tuple(parts.split.take(full, p, copy=False) for p in range(parts.tp))

    @staticmethod
    def backward(ctx, *grads):
        return ctx.parts.grad(grads, ctx.shape), None


# --- entering and leaving the region ----------------------------------------------------------


class EmulatedEntry:
    """Enter the TP region: every rank's copy of the input (a list of tp tensors).

    The emulated f, or with sequence parallelism active the all-gather at ``fwd`` followed by
    the copies; ``bwd`` sums the ranks' input gradients.
    """

    def __init__(self, group: EmulatedGroup, fwd: Site | None, bwd: Site, sequence: SequenceState | None = None):
        self.group, self.fwd, self.bwd, self.sequence = group, fwd, bwd, sequence

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.group.world == 1:
            return [x]
        if self.sequence is not None and self.sequence.active:
            x = _GatherSequence.apply(x, self.group, self.fwd, SEQ_DIM)  # shards -> (b, s, h) decoded
            return list(_FanOut.apply(x, self.group, self.bwd, SEQ_DIM))
        return list(_FanOut.apply(x, self.group, self.bwd, None))


class EmulatedExit:
    """Leave the TP region: the sum of the tp partials (g), or their reduce-scatter with
    sequence parallelism active. Replaceable on a layer like `RegionExit`."""

    def __init__(self, group: EmulatedGroup, fwd: Site, bwd: Site | None = None, sequence: SequenceState | None = None):
        self.group, self.fwd, self.bwd, self.sequence = group, fwd, bwd, sequence

    def __call__(self, partials: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.group.world == 1:
            return partials[0]
        if self.sequence is not None and self.sequence.active:
            return _ReduceScatterSequence.apply(self.group, self.fwd, self.bwd, SEQ_DIM, *partials)
        return _Reduce.apply(self.group, self.fwd, *partials)


class EmulatedRegion(HiddenStatesHook):
    """Forward pre-hook of a module whose column-parallel layers share one entry (attention:
    q/k/v; MLP: gate/up): enters once, passes rank 0's copy on as ``hidden_states`` and hands
    every rank's copy to each of the ``consumers`` column layers that receive it (`inputs`),
    then lets go of them."""

    def __init__(self, entry: EmulatedEntry) -> None:
        self.entry, self.consumers = entry, 0
        self._copies: list[torch.Tensor] | None = None
        self._left = 0

    def rewrite(self, hidden: torch.Tensor) -> torch.Tensor:
        self._copies, self._left = self.entry(hidden), self.consumers
        return self._copies[0]

    def inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of ``x``, which must be what the hook passed on."""
        copies = self._copies
        if copies is None or x is not copies[0]:
            raise RuntimeError(
                "an emulated column-parallel layer received a tensor that did not come through its "
                "region's entry (or read it more often than its region has column layers); the plan's "
                "EnterRegion module must pass hidden_states straight to each of them, once"
            )
        self._left -= 1
        if self._left <= 0:
            self._copies = None  # the layers hold what backward needs; do not keep activations alive
        return copies


class EmulatedSequenceSplit(HiddenStatesHook):
    """Forward pre-hook of the first layer: start the forward's sequence parallelism (the split
    itself moves nothing; its backward all-gathers the gradient at ``bwd``)."""

    def __init__(self, group: EmulatedGroup, bwd: Site, sequence: SequenceState) -> None:
        self.group, self.bwd, self.sequence = group, bwd, sequence

    def rewrite(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.sequence.begin(hidden.shape[SEQ_DIM]):
            return _SplitSequence.apply(hidden, self.group, self.bwd, SEQ_DIM)
        return None


class EmulatedSequenceGather:
    """Forward hook of the final norm: all-gather the sequence shards at ``fwd`` for the lm head."""

    def __init__(self, group: EmulatedGroup, fwd: Site, sequence: SequenceState) -> None:
        self.group, self.fwd, self.sequence = group, fwd, sequence

    def __call__(self, module, args, output):
        if not self.sequence.active:
            return None
        return _GatherSequence.apply(output, self.group, self.fwd, SEQ_DIM)


# --- layers -----------------------------------------------------------------------------------


def rank_order(outputs: Sequence[torch.Tensor], split: ShardSpec, dim: int = -1) -> torch.Tensor:
    """Every rank's local output concatenated along ``dim``, segment by segment (the layout of
    the module docstring): segment j of rank 0, of rank 1, ..., then segment j + 1."""
    if len(split.ranges[0]) == 1:
        return torch.cat(list(outputs), dim)
    pieces = []
    for j in range(len(split.ranges[0])):
        for rank, out in enumerate(outputs):
            ranges = split.ranges[rank]
            offset = sum(stop - start for start, stop in ranges[:j])
            pieces.append(out.narrow(dim, offset, ranges[j][1] - ranges[j][0]))
    return torch.cat(pieces, dim)


class _EmulatedLinear(nn.Module):
    """The full ``weight`` / ``bias`` of an ``nn.Linear`` or ``Conv1D`` (the same parameter
    objects, so names, tying and checkpoints stay those of transformers) and ``split``, the
    per-rank slicing real TP would use. ``split`` is not called ``shards``: the parameters are
    whole, and `shard_specs` must not slice them."""

    def __init__(self, module: nn.Module, split: ShardSpec, group: EmulatedGroup) -> None:
        super().__init__()
        self.in_features, self.out_features, self.conv1d = linear_layout(module)
        self.group, self.tp, self.split = group, group.world, split
        self.weight_parts = RankParts(split)
        self.weight = module.weight
        if module.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = module.bias

    def _local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight.t() if self.conv1d else weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp}, emulated" + (", conv1d" if self.conv1d else "")
        )


class EmulatedColumnParallelLinear(_EmulatedLinear):
    """`ColumnParallelLinear` for tp virtual ranks: rank p's ``x_p @ W_p.T + b_p``, in rank order.

    The rank copies of the input come from ``entry`` (the lm head enters on its own), from
    ``region`` (q/k/v, gate/up share their module's entry), or, with neither, are the input
    itself (gradients then add up exactly, with no site).
    """

    def __init__(
        self, module: nn.Module, split: ShardSpec, group: EmulatedGroup, *,
        entry: EmulatedEntry | None = None, region: EmulatedRegion | None = None,
    ) -> None:
        conv1d = linear_layout(module).conv1d
        super().__init__(module, split.on_dim(1 if conv1d else 0), group)
        self.entry, self.region = entry, region
        self.bias_split = self.split.on_dim(0)
        self.bias_parts = RankParts(self.bias_split)
        if region is not None:
            region.consumers += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            xs = self.entry(x)
        elif self.region is not None:
            xs = self.region.inputs(x)
        else:
            xs = [x] * self.tp
        weights = self.weight_parts(self.weight)
        biases = [None] * self.tp if self.bias is None else self.bias_parts(self.bias)
        outs = [self._local_linear(xs[p], weights[p], biases[p]) for p in range(self.tp)]  # tp x (b, s, out/tp)
        return rank_order(outs, self.split)  # (b, s, out), replicated kv heads once per rank


class EmulatedRowParallelLinear(_EmulatedLinear):
    """`RowParallelLinear` for tp virtual ranks: `partials` computes rank p's
    ``x[..., in_p] @ W[:, in_p].T``; ``reduce`` (an `EmulatedExit`) sums them; then the bias."""

    def __init__(self, module: nn.Module, split: ShardSpec, group: EmulatedGroup, *, reduce: EmulatedExit) -> None:
        conv1d = linear_layout(module).conv1d
        super().__init__(module, split.on_dim(0 if conv1d else 1), group)
        self.input_split = split.on_dim(-1)
        self.input_parts = RankParts(self.input_split)
        self.reduce = reduce

    def partials(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's partial product, (b, s, in) -> tp x (b, s, out), no bias."""
        xs, weights = self.input_parts(x), self.weight_parts(self.weight)
        return [self._local_linear(xs[p], weights[p], None) for p in range(self.tp)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.reduce(self.partials(x))  # (b, s, out)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # bf16 under autocast, as nn.Linear's


class EmulatedVocabParallelEmbedding(nn.Module):
    """`VocabParallelEmbedding` for tp virtual ranks: rank p's partial is the lookup with the
    ids outside its rows zeroed; ``reduce`` sums the partials."""

    def __init__(self, module: nn.Embedding, group: EmulatedGroup, *, reduce: EmulatedExit) -> None:
        super().__init__()
        tp = group.world
        if module.num_embeddings < tp:
            raise ValueError(f"a vocabulary of {module.num_embeddings} cannot be split over tp={tp} ranks")
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.padding_idx, self.group, self.tp, self.reduce = module.padding_idx, group, tp, reduce
        self.split = ShardSpec.balanced(module.num_embeddings, tp)
        self.weight = module.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight, self.padding_idx)  # (b, s, h): every rank's rows
        partials = []
        for ((start, stop),) in self.split.ranges:
            outside = (input_ids < start) | (input_ids >= stop)
            partials.append(out.masked_fill(outside.unsqueeze(-1), 0.0))
        return self.reduce(partials)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, tp={self.tp}, emulated"
