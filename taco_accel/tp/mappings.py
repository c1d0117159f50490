"""The TP communication functions, one autograd function per Megatron mapping.

Each function moves a tensor through one `Site` (its process group, codec settings, decision and
statistics; `taco_accel.comm.Site`); a site without settings is the plain collective.
Conjugate pairs (Megatron-LM mappings.py; "f" and "g" of the Megatron paper, sec. 3):

    copy_to_tp_region            forward: identity        backward: all-reduce       (f)
    reduce_from_tp_region        forward: all-reduce      backward: identity         (g)
    gather_from_tp_region        forward: all-gather      backward: keep own part
    scatter_to_sp_region         forward: keep own block  backward: all-gather
    gather_from_sp_region        forward: all-gather      backward: reduce-scatter (or keep own block)
    reduce_scatter_to_sp_region  forward: reduce-scatter  backward: all-gather

Sequence parallelism splits a tensor into P *blocks*: block r is the r-th of P equal
contiguous parts of its memory, shaped like the tensor with ``dim`` divided by P. Hidden states
are batch-first (b, s, h) as in transformers, so block r holds rows [r*b*s/P, (r+1)*b*s/P) of
the (b*s, h) token rows, shaped (b, s/P, h): at batch 1 rank r's part of the sequence, at
batch > 1 another set of b*s/P tokens, which the per-token work between blocks (norms,
dropout, residual adds) does not tell apart. Every SP collective then moves contiguous memory:
no to-and-from layout copies (Megatron gets the same with sequence-first tensors).

The forward all-reduce (g) of a layer reduces in place: its input is the partial product that
the layer just computed (Megatron's ``_reduce``). With one rank every function is the identity.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..comm.copies import SharesGroup
from ..comm.dist_ops import group_rank, group_size
from .shards import ShardSpec
from .sites import Site


def _all_reduce(x: torch.Tensor, site: Site, inplace: bool = False) -> torch.Tensor:
    """The sum over ``site``'s group; ``inplace``: x is ours to reduce in place."""
    return site.collective("all_reduce", x, inplace=inplace)


def _all_gather(x: torch.Tensor, site: Site, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (any dim: a copy reorders the gathered
    (P, *x.shape) unless every dim before ``dim`` has size 1)."""
    out = site.collective("all_gather", x.contiguous().unsqueeze(0))  # (P, *x.shape)
    shape = list(x.shape)
    shape[dim] *= out.shape[0]
    return out.movedim(0, dim).reshape(shape)


def _gather_blocks(x: torch.Tensor, site: Site, dim: int) -> torch.Tensor:
    """Every rank's block ``x`` -> the whole tensor (x's shape, ``dim`` P times longer): the
    blocks in rank order are its memory, so the gathered buffer is the tensor (no copy)."""
    out = site.collective("all_gather", x.contiguous())  # (P*x.shape[0], ...): blocks in rank order
    shape = list(x.shape)
    shape[dim] *= site.world
    return out.view(shape)


def _reduce_scatter_blocks(x: torch.Tensor, site: Site, dim: int) -> torch.Tensor:
    """This rank's block of the sum of every rank's ``x`` (x's shape, ``dim`` divided by P)."""
    world = site.world
    shape = list(x.shape)
    shape[dim] //= world
    blocks = x.contiguous().view(world, -1, x.shape[-1])  # (P, b*s/P, h): rank r's block at [r]
    return site.collective("reduce_scatter", blocks).view(shape)


def blocks(x: torch.Tensor, parts: int, dim: int) -> tuple[torch.Tensor, ...]:
    """The ``parts`` blocks of ``x`` (module docstring), in rank order: views of its memory (of
    a contiguous copy if x is not contiguous), each of x's shape with ``dim`` divided by ``parts``."""
    shape = list(x.shape)
    shape[dim] //= parts
    return tuple(block.view(shape) for block in x.contiguous().view(parts, -1))


def _block(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's block of ``x``."""
    return blocks(x, group_size(group), dim)[group_rank(group)]


class _CopyToTPRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, bwd: Site):
        ctx.bwd = bwd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.bwd), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: forward all-reduce (in place on the partial product when ``inplace``), backward identity."""

    @staticmethod
    def forward(ctx, x, fwd: Site, inplace: bool):
        if (not inplace or torch.compiler.is_compiling() or not x.is_contiguous() or x._base is not None
                or (x.is_leaf and x.requires_grad)):
            return _all_reduce(x, fwd)  # the compiled op is out of place; a view or a parameter is not ours
        ctx.mark_dirty(x)
        _all_reduce(x, fwd, inplace=True)  # the sum written into x
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTPRegion(torch.autograd.Function):
    """Forward: all-gather along ``dim`` (parts may differ in size), backward: keep own part.

    Only right when what follows is replicated (every rank computes the same thing from the
    gathered tensor), so that every rank already holds the whole gradient.
    """

    @staticmethod
    def forward(ctx, x, fwd: Site, dim: int, sizes: Sequence[int] | None):
        rank = group_rank(fwd.group)
        sizes = list(sizes) if sizes is not None else [x.shape[dim]] * group_size(fwd.group)
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:rank]), sizes[rank]
        pad = max(sizes) - x.shape[dim]
        if pad:  # uneven parts (a vocabulary of any size): pad to the largest, cut after
            x = torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1 :])], dim=dim)
        gathered = _all_gather(x, fwd, dim)
        if not pad and len(set(sizes)) == 1:
            return gathered  # even parts: nothing to cut
        parts = gathered.split(max(sizes), dim=dim)
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None


class _ScatterToSPRegion(torch.autograd.Function):
    """Forward: keep own block, backward: all-gather the gradient blocks."""

    @staticmethod
    def forward(ctx, x, bwd: Site, dim: int):
        ctx.bwd, ctx.dim = bwd, dim
        return _block(x, bwd.group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_blocks(grad, ctx.bwd, ctx.dim), None, None


class _GatherFromSPRegion(torch.autograd.Function):
    """Forward: all-gather the blocks, backward: reduce-scatter the gradient (``bwd``), or keep
    own block (``bwd`` None: what follows is replicated, every rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x, fwd: Site, bwd: Site | None, dim: int):
        ctx.fwd, ctx.bwd, ctx.dim = fwd, bwd, dim
        return _gather_blocks(x, fwd, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.bwd is None:
            return _block(grad, ctx.fwd.group, ctx.dim), None, None, None
        return _reduce_scatter_blocks(grad, ctx.bwd, ctx.dim), None, None, None


class _ReduceScatterToSPRegion(torch.autograd.Function):
    """Forward: reduce-scatter into blocks, backward: all-gather the gradient blocks."""

    @staticmethod
    def forward(ctx, x, fwd: Site, bwd: Site, dim: int):
        ctx.bwd, ctx.dim = bwd, dim
        return _reduce_scatter_blocks(x, fwd, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_blocks(grad, ctx.bwd, ctx.dim), None, None, None


def copy_to_tp_region(x: torch.Tensor, bwd: Site) -> torch.Tensor:
    """f: enter the TP region; the input gradient is all-reduced at site ``bwd``."""
    return x if group_size(bwd.group) == 1 else _CopyToTPRegion.apply(x, bwd)


def reduce_from_tp_region(x: torch.Tensor, fwd: Site, inplace: bool = False) -> torch.Tensor:
    """g: leave the TP region by summing the partial results at site ``fwd``. ``inplace``: x is
    the caller's temporary (a partial product, as in Megatron), reduced in place and returned."""
    return x if group_size(fwd.group) == 1 else _ReduceFromTPRegion.apply(x, fwd, inplace)


def gather_from_tp_region(
    x: torch.Tensor, fwd: Site, dim: int = -1, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's part along ``dim`` (``sizes[r]``: rank r's part; default equal)."""
    if group_size(fwd.group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, fwd, dim % x.dim(), sizes)


def scatter_to_sp_region(x: torch.Tensor, bwd: Site, dim: int = 1) -> torch.Tensor:
    """Enter sequence parallelism: keep this rank's block (module docstring), (b, s, h) -> (b, s/P, h)."""
    return x if group_size(bwd.group) == 1 else _ScatterToSPRegion.apply(x, bwd, dim)


def gather_from_sp_region(x: torch.Tensor, fwd: Site, bwd: Site | None = None, dim: int = 1) -> torch.Tensor:
    """Blocks -> the whole tensor, (b, s/P, h) -> (b, s, h): before a column-parallel region (its
    input gradient reduce-scattered at ``bwd``), or for a replicated consumer (``bwd=None``)."""
    return x if group_size(fwd.group) == 1 else _GatherFromSPRegion.apply(x, fwd, bwd, dim)


def reduce_scatter_to_sp_region(x: torch.Tensor, fwd: Site, bwd: Site, dim: int = 1) -> torch.Tensor:
    """Partial sums -> this rank's block of the sum, (b, s, h) -> (b, s/P, h), after a row-parallel region."""
    return x if group_size(fwd.group) == 1 else _ReduceScatterToSPRegion.apply(x, fwd, bwd, dim)


class _SumReplicaGrads(torch.autograd.Function):
    """Forward: identity on a weight whose blocks several ranks hold (replicated kv heads),
    backward: sum the gradient of each block over the ranks that hold it."""

    @staticmethod
    def forward(ctx, weight, shard: ShardSpec, bwd: Site):
        ctx.shard, ctx.bwd = shard, bwd
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        shard, rank = ctx.shard, group_rank(ctx.bwd.group)
        shape = list(grad.shape)
        shape[shard.dim] = shard.full_size
        full = grad.new_zeros(shape)  # every rank writes its blocks, the sum adds replicas
        shard.place(grad, rank, full)
        return shard.take(_all_reduce(full, ctx.bwd, inplace=True), rank), None, None


def sum_replica_grads(weight: torch.Tensor, shard: ShardSpec, bwd: Site) -> torch.Tensor:
    """``weight`` itself; its gradient is summed over the ranks holding the same blocks."""
    return weight if shard.replicas == 1 else _SumReplicaGrads.apply(weight, shard, bwd)


class GradSumBucket(SharesGroup):
    """Sum the gradients of replicated parameters that each rank applies to part of the data
    (norms under sequence parallelism, Qwen3's per-head norms) over ``site.group``: ONE
    all-reduce per backward for all of them, instead of one per parameter.

    Each parameter's hook keeps this backward's gradient and passes zeros on (so ``.grad``
    accumulates nothing yet); at the end of backward one flat all-reduce per dtype sums them
    and adds the sums to ``.grad``: the same numbers as summing in each hook (``.grad + 0`` is
    exact). Gradients must accumulate into ``.grad`` (``loss.backward()``), as they do when
    training; ``torch.autograd.grad`` on these parameters would see zeros.
    """

    _fresh = ("handles", "_grads", "_queued")  # a copy hooks its own parameters (`_copied`)

    def __init__(self, params, site: Site) -> None:
        self.params, self.site = list(params), site
        self._hook()

    def _hook(self) -> None:
        self._grads: dict[int, torch.Tensor] = {}
        self._queued = False
        self.handles = [p.register_hook(functools.partial(self._keep, i)) for i, p in enumerate(self.params)]

    def _copied(self, original: "GradSumBucket") -> None:
        self._hook()  # on the copy's own parameters: a parameter's copy has no hooks

    def _keep(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        self._grads[index] = grad
        if not self._queued:  # the engine runs callbacks once this backward is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        return torch.zeros_like(grad)

    def _flush(self) -> None:
        grads, self._grads, self._queued = self._grads, {}, False
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index in sorted(grads):  # the same order on every rank
            by_dtype.setdefault(grads[index].dtype, []).append(index)
        for dtype in sorted(by_dtype, key=str):
            indices = by_dtype[dtype]
            summed = _all_reduce(torch.cat([grads[i].reshape(-1) for i in indices]), self.site, inplace=True)
            for i, part in zip(indices, summed.split([grads[i].numel() for i in indices])):
                param = self.params[i]
                if param.grad is None:
                    param.grad = part.view_as(grads[i]).clone()
                else:
                    param.grad.add_(part.view_as(param.grad))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
