"""Communication hidden behind compute in the TP layers.

A column-parallel region (q/k/v behind one entry, gate/up, the lm head on its own) computes
the outputs of all its column layers in one autograd function, `ColumnRegion`, so that its
backward can overlap as Megatron does::

    grad_x = grad_x_passed_on + sum_i grad_y_i @ W_i          # (b, s, h) input gradient
    pending = all_reduce(grad_x, async_op=True)               # f's all-reduce on the wire ...
    for each layer i: grad_W_i = grad_y_i^T x, grad_b_i       # ... while the weight gradients run
    return pending.wait()                                     #     (compressed: a piece per matmul)

With sequence parallelism active (async TP's decomposition: the per-rank collective kinds of
`comm.collectives`, ``site.gather_by_rank`` / ``site.scatter_by_rank``; a rank's part is its
block of the token rows, `mappings`):

    column forward   all-gather of the (b, s/tp, h) blocks as one broadcast per rank, each
                     received straight into its place in the (b, s, h) input; each rank's
                     block is multiplied by every W_i as soon as it lands
    column backward  the input gradient's rows of rank r computed and sent (a reduction to r)
                     while rank r+1's are computed; the weight gradients while the last travel
    row forward      (`RowSequenceLinear`) rank r's rows of the partial product computed and
                     sent while rank r+1's are computed
    row backward     the gradient shards all-gathered by broadcasts, each multiplied as it lands

The numbers are the unfused path's (compression off: up to the fp32 rounding of matmuls on row
subsets; compressed: the same groups, the same codec). Under autocast both functions follow
``nn.Linear`` (`autocast.MatmulCast`): the matmuls in the autocast dtype, the input gradient
summed and sent in the input's dtype, the row reduce-scatter in the autocast dtype (the dtype
of the unparallelised layer's output). `OverlapState` switches it
(``model.taco.overlap.enabled``); it is off under torch.compile (the compiled graph keeps the
unfused collectives) and with one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.dist_ops import group_size
from .autocast import MatmulCast
from .mappings import blocks
from .regions import SEQ_DIM, RegionEntry


class OverlapState:
    """Whether the TP layers of one model overlap communication and compute (on by default)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def active(self, group) -> bool:
        return self.enabled and group_size(group) > 1 and not torch.compiler.is_compiling()

    def __repr__(self) -> str:
        return f"OverlapState(enabled={self.enabled})"


def _linear(x, weight, bias, conv1d: bool):
    return F.linear(x, weight.t() if conv1d else weight, bias)


def _input_grad(grad, weight, conv1d: bool):
    """d(x W^T)/dx (``nn.Linear`` weight [out, in]) or d(x W)/dx (``Conv1D`` weight [in, out])."""
    return grad @ (weight.t() if conv1d else weight)


def _weight_grad(grad, x, conv1d: bool):
    g, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return x.t() @ g if conv1d else g.t() @ x


class ColumnRegion:
    """Enter the TP region once for the column layers in ``layers`` and compute their outputs.

    Called like a `RegionEntry` (``x -> entered x``); each layer then finds its output ready
    (`ColumnParallelLinear.forward` takes it when it receives the entered ``x``). Falls back to
    the entry alone (each layer multiplies itself) when overlap is off, or without gradients
    outside sequence parallelism (there is nothing to overlap then).
    """

    def __init__(self, entry: RegionEntry, overlap: OverlapState) -> None:
        self.entry, self.overlap = entry, overlap
        self.layers: list = []  # ColumnParallelLinear, in plan order

    @property
    def bwd(self):
        return self.entry.bwd

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sequence = self.entry.sequence
        sp = sequence is not None and sequence.active
        if not self.layers or not self.overlap.active(self.bwd.group) or not (sp or torch.is_grad_enabled()):
            return self.entry(x)
        params = [layer.region_params() for layer in self.layers]
        outs = _ColumnRegionFn.apply(x, self, sp, *(w for w, _ in params), *(b for _, b in params))
        for layer, y in zip(self.layers, outs[1:]):
            layer.ready = (outs[0], y)
        return outs[0]

    def __repr__(self) -> str:
        return f"ColumnRegion({self.bwd.name.rsplit('/', 1)[0]!r}, {len(self.layers)} layers)"


class _ColumnRegionFn(torch.autograd.Function):
    """Forward: enter (identity, or the sequence all-gather) and every layer's x W_i^T + b_i;
    backward: the input gradient's collective overlapped with the weight gradients."""

    @staticmethod
    def forward(ctx, x, region: ColumnRegion, sp: bool, *params):
        n = len(region.layers)
        cast = MatmulCast(x.device.type)
        ctx.dtypes = [x.dtype] + [w.dtype for w in params[:n]] + [b.dtype for b in params[n:] if b is not None]
        weights, biases = [cast(w) for w in params[:n]], [cast(b) for b in params[n:]]
        conv = [layer.conv1d for layer in region.layers]
        if sp:
            entered, x, ys = _gather_then_multiply(x, region.entry.fwd, weights, biases, conv, cast)  # (b, s, h)
        else:
            entered, x = x.view_as(x), cast(x)
            ys = [_linear(x, w, b, c) for w, b, c in zip(weights, biases, conv)]
        ctx.save_for_backward(x, *weights)  # the casts, as nn.Linear's backward under autocast keeps them
        ctx.region, ctx.sp, ctx.conv, ctx.bias = region, sp, conv, [b is not None for b in biases]
        return (entered, *ys)

    @staticmethod
    def backward(ctx, grad_x, *grad_ys):
        x, *weights = ctx.saved_tensors
        site = ctx.region.bwd
        n = len(weights)
        x_dtype, w_dtypes, b_dtypes = ctx.dtypes[0], ctx.dtypes[1:1 + n], iter(ctx.dtypes[1 + n:])
        grad_ys = [None if gy is None else gy.to(x.dtype) for gy in grad_ys]  # the matmul dtype
        if ctx.sp:
            pending = _scatter_input_grad(x, grad_x, grad_ys, weights, ctx.conv, site, x_dtype)
        else:
            grad, inplace = grad_x, False  # the incoming gradient is not ours to overwrite
            for gy, w, c in zip(grad_ys, weights, ctx.conv):
                if gy is not None:
                    term = MatmulCast.grad_for(_input_grad(gy, w, c), x_dtype)
                    grad, inplace = (term if grad is None else grad + term), True
            pending = site.run("all_reduce", grad, inplace=inplace, async_op=True)
        grad_w, grad_b = [None] * n, [None] * n
        for i, (gy, c) in enumerate(zip(grad_ys, ctx.conv)):
            b_dtype = next(b_dtypes) if ctx.bias[i] else None
            if gy is None:
                continue
            if ctx.needs_input_grad[3 + i]:
                grad_w[i] = MatmulCast.grad_for(_weight_grad(gy, x, c), w_dtypes[i])
            if ctx.bias[i] and ctx.needs_input_grad[3 + n + i]:
                grad_b[i] = MatmulCast.grad_for(gy.reshape(-1, gy.shape[-1]).sum(0), b_dtype)
            pending.progress()
        return (pending.wait(), None, None, *grad_w, *grad_b)


def _gather_then_multiply(shard, site, weights, biases, conv, cast: MatmulCast):
    """The all-gather of the block ``shard`` (b, s/tp, h) into the whole (b, s, h), each rank's
    block multiplied as it lands; returns the whole input, its cast to the matmul dtype (the
    blocks cast once, as they land) and each layer's whole output."""
    if site.samples is not None:
        site.observe(shard)
    world = site.link.world
    full = shard.new_empty(_whole(shard.shape, world))  # (b, s, h): rank r's block is its r-th tp-th
    cast_full = full.new_empty(full.shape, dtype=cast.dtype) if cast.changes(shard) else full  # filled per block
    cast_blocks = blocks(cast_full, world, SEQ_DIM)
    parts = site.gather_by_rank(shard, out=full)
    ys = [[None] * world for _ in weights]
    for rank, part in parts.landed():  # (b, s/tp, h) each, a view of full
        if cast_full is not full:
            part = cast_blocks[rank].copy_(part)
        for y, w, b, c in zip(ys, weights, biases, conv):
            y[rank] = _linear(part, w, b, c)
    parts.wait()
    return full, cast_full, [_join(y) for y in ys]


def _whole(shape, world: int) -> tuple[int, ...]:
    """The shape of the whole tensor whose blocks have ``shape``."""
    return (shape[0], shape[SEQ_DIM] * world, *shape[SEQ_DIM + 1:])


def _join(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's block (b, s/tp, ...) -> the whole tensor (b, s, ...): the blocks in rank order."""
    return torch.cat([b.reshape(-1) for b in blocks]).view(_whole(blocks[0].shape, len(blocks)))


def _scatter_input_grad(x_full, grad_x, grad_ys, weights, conv, site, dtype):
    """Submit rank r's block of the input gradient of ``x_full`` (b, s, h) to its reduction as
    soon as it is computed, in ``dtype`` (the input's); returns a handle whose ``wait`` gives
    this rank's (b, s/tp, h)."""
    world = site.link.world
    block = list(x_full.shape)
    block[SEQ_DIM] //= world
    sums = site.scatter_by_rank(block, dtype, x_full.device)
    grad_x = None if grad_x is None else blocks(grad_x, world, SEQ_DIM)
    grad_ys = [None if gy is None else blocks(gy, world, SEQ_DIM) for gy in grad_ys]
    for rank in range(world):
        part, inplace = (None if grad_x is None else grad_x[rank]), False  # a view of the incoming gradient
        for gy, w, c in zip(grad_ys, weights, conv):
            if gy is not None:
                term = MatmulCast.grad_for(_input_grad(gy[rank], w, c), dtype)
                part, inplace = (term if part is None else part + term), True
        if site.samples is not None:
            site.observe(part)
        sums.submit(rank, part, inplace)
    return sums  # a `comm.Call`: progress (nothing between parts), wait


class RowSequenceLinear(torch.autograd.Function):
    """A row-parallel product leaving the TP region under sequence parallelism: forward the
    reduce-scatter of ``x W^T`` cut per destination rank, backward the all-gather of the
    gradient blocks, each multiplied as it lands. ``exit`` is the layer's `RegionExit`."""

    @staticmethod
    def forward(ctx, x, weight, conv1d: bool, exit_):
        site = exit_.fwd
        world = site.link.world
        cast = MatmulCast(x.device.type)
        ctx.dtypes = x.dtype, weight.dtype
        x, weight = cast(x), cast(weight)  # the product and its reduce-scatter in the matmul dtype
        block = list(x.shape[:-1]) + [weight.shape[1] if conv1d else weight.shape[0]]
        block[SEQ_DIM] //= world
        sums = site.scatter_by_rank(block, x.dtype, x.device)
        for rank, rows in enumerate(blocks(x, world, SEQ_DIM)):
            part = _linear(rows, weight, None, conv1d)  # (b, s/tp, out)
            if site.samples is not None:
                site.observe(part)
            sums.submit(rank, part, inplace=True)
        ctx.save_for_backward(x, weight)
        ctx.conv1d, ctx.site = conv1d, exit_.bwd
        return sums.wait()  # (b, s/tp, out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        site = ctx.site
        if site.samples is not None:
            site.observe(grad)
        world = site.link.world
        full = grad.new_empty(_whole(grad.shape, world))  # (b, s, out)
        parts = site.gather_by_rank(grad, out=full)
        grads_x = [None] * world
        x_dtype, w_dtype = ctx.dtypes
        for rank, g in parts.landed():  # (b, s/tp, out) each, a view of full
            if ctx.needs_input_grad[0]:
                grads_x[rank] = MatmulCast.grad_for(_input_grad(g.to(x.dtype), weight, ctx.conv1d), x_dtype)
        parts.wait()
        grad_x = _join(grads_x) if ctx.needs_input_grad[0] else None
        grad_w = MatmulCast.grad_for(_weight_grad(full.to(x.dtype), x, ctx.conv1d), w_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None
