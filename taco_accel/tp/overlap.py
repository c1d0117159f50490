"""Communication hidden behind compute in the TP layers.

A column-parallel region (q/k/v behind one entry, gate/up, the lm head on its own) computes
the outputs of all its column layers in one autograd function, `ColumnRegion`, so that its
backward can overlap as Megatron does::

    grad_x = grad_x_passed_on + sum_i grad_y_i @ W_i          # (b, s, h) input gradient
    pending = all_reduce(grad_x, async_op=True)               # f's all-reduce on the wire ...
    for each layer i: grad_W_i = grad_y_i^T x, grad_b_i       # ... while the weight gradients run
    return pending.wait()                                     #     (compressed: a piece per matmul)

With sequence parallelism active (async TP's decomposition, `comm.chunked`):

    column forward   all-gather of the (b, s/tp, h) shards as one broadcast per rank; each
                     rank's shard is multiplied by every W_i as soon as it lands
    column backward  the input gradient's rows of rank r computed and sent (a reduction to r)
                     while rank r+1's are computed; the weight gradients while the last travel
    row forward      (`RowSequenceLinear`) rank r's rows of the partial product computed and
                     sent while rank r+1's are computed
    row backward     the gradient shards all-gathered by broadcasts, each multiplied as it lands

The numbers are the unfused path's (compression off: up to the fp32 rounding of matmuls on row
subsets; compressed: the same groups, the same codec). `OverlapState` switches it
(``model.taco.overlap.enabled``); it is off under torch.compile (the compiled graph keeps the
unfused collectives) and with one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..comm.chunked import GatherChunks, ScatterChunks
from ..comm.dist_ops import group_size
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
        weights, biases = params[:n], params[n:]
        conv = [layer.conv1d for layer in region.layers]
        if sp:
            x, ys = _gather_then_multiply(x, region.entry.fwd, weights, biases, conv)  # (b, s, h)
            entered = x
        else:
            ys = [_linear(x, w, b, c) for w, b, c in zip(weights, biases, conv)]
            entered = x.view_as(x)
        ctx.save_for_backward(x, *weights)
        ctx.region, ctx.sp, ctx.conv, ctx.bias = region, sp, conv, [b is not None for b in biases]
        return (entered, *ys)

    @staticmethod
    def backward(ctx, grad_x, *grad_ys):
        x, *weights = ctx.saved_tensors
        site = ctx.region.bwd
        n = len(weights)
        if ctx.sp:
            pending = _scatter_input_grad(x, grad_x, grad_ys, weights, ctx.conv, site)
        else:
            grad = grad_x
            for gy, w, c in zip(grad_ys, weights, ctx.conv):
                if gy is not None:
                    term = _input_grad(gy, w, c)
                    grad = term if grad is None else grad + term
            site.observe(grad)
            pending = comm.all_reduce(grad, site.group, site.call_config("all_reduce", grad), site=site.name,
                                      async_op=True)
        grad_w, grad_b = [None] * n, [None] * n
        for i, (gy, c) in enumerate(zip(grad_ys, ctx.conv)):
            if gy is None:
                continue
            if ctx.needs_input_grad[3 + i]:
                grad_w[i] = _weight_grad(gy, x, c)
            if ctx.bias[i] and ctx.needs_input_grad[3 + n + i]:
                grad_b[i] = gy.reshape(-1, gy.shape[-1]).sum(0)
            pending.progress()
        return (pending.wait(), None, None, *grad_w, *grad_b)


def _gather_then_multiply(shard, site, weights, biases, conv):
    """The sequence all-gather of ``shard`` (b, s/tp, h), each rank's part multiplied as it lands."""
    site.observe(shard)
    parts = GatherChunks(shard, site.group, site.call_config("all_gather", shard), site=site.name)
    world = parts.world
    xs, ys = [None] * world, [[None] * world for _ in weights]
    for rank, part in parts:  # (b, s/tp, h) each
        xs[rank] = part
        for y, w, b, c in zip(ys, weights, biases, conv):
            y[rank] = _linear(part, w, b, c)
    parts.finish()
    return torch.cat(xs, dim=SEQ_DIM), [torch.cat(y, dim=SEQ_DIM) for y in ys]


class _Rows:
    """Rank r's rows along the sequence of (b, s, ...) tensors: ``[:, r*m:(r+1)*m]``."""

    def __init__(self, seq: int, world: int) -> None:
        self.m = seq // world

    def __call__(self, t: torch.Tensor | None, rank: int):
        return None if t is None else t.narrow(SEQ_DIM, rank * self.m, self.m)


def _scatter_input_grad(x_full, grad_x, grad_ys, weights, conv, site):
    """Submit rank r's rows of the input gradient of ``x_full`` (b, s, h) to its reduction as
    soon as they are computed; returns a handle whose ``wait`` gives this rank's (b, s/tp, h)."""
    world = group_size(site.group)
    rows = _Rows(x_full.shape[SEQ_DIM], world)
    block = (world, x_full.shape[0], rows.m, x_full.shape[-1])
    config = site.call_config_like("reduce_scatter", block, x_full.dtype, x_full.device)
    sums = ScatterChunks(site.group, config, site=site.name)
    for rank in range(world):
        part, owned = rows(grad_x, rank), False  # a view of the incoming gradient: not ours to overwrite
        for gy, w, c in zip(grad_ys, weights, conv):
            if gy is not None:
                term = _input_grad(rows(gy, rank), w, c)
                part, owned = (term if part is None else part + term), True
        site.observe(part)
        sums.submit(rank, part, owned)
    return _Waiting(sums)


class _Waiting:
    """A `ScatterChunks` with the `Pending` interface (nothing to advance between matmuls)."""

    def __init__(self, sums: ScatterChunks) -> None:
        self.sums = sums

    def progress(self) -> None:
        pass

    def wait(self) -> torch.Tensor:
        return self.sums.wait()


class RowSequenceLinear(torch.autograd.Function):
    """A row-parallel product leaving the TP region under sequence parallelism: forward the
    reduce-scatter of ``x W^T`` cut per destination rank, backward the all-gather of the
    gradient shards, each multiplied as it lands. ``exit`` is the layer's `RegionExit`."""

    @staticmethod
    def forward(ctx, x, weight, conv1d: bool, exit_):
        site, world = exit_.fwd, group_size(exit_.fwd.group)
        rows = _Rows(x.shape[SEQ_DIM], world)
        out_features = weight.shape[1] if conv1d else weight.shape[0]
        block = (world, x.shape[0], rows.m, out_features)
        sums = ScatterChunks(site.group, site.call_config_like("reduce_scatter", block, x.dtype, x.device),
                             site=site.name)
        for rank in range(world):
            part = _linear(rows(x, rank), weight, None, conv1d)  # (b, s/tp, out)
            site.observe(part)
            sums.submit(rank, part, owned=True)
        ctx.save_for_backward(x, weight)
        ctx.conv1d, ctx.site = conv1d, exit_.bwd
        return sums.wait()  # (b, s/tp, out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        site = ctx.site
        site.observe(grad)
        parts = GatherChunks(grad, site.group, site.call_config("all_gather", grad), site=site.name)
        grads_x, shards = [None] * parts.world, [None] * parts.world
        for rank, g in parts:  # (b, s/tp, out) each
            shards[rank] = g
            grads_x[rank] = _input_grad(g, weight, ctx.conv1d) if ctx.needs_input_grad[0] else None
        parts.finish()
        grad_x = torch.cat(grads_x, dim=SEQ_DIM) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(torch.cat(shards, dim=SEQ_DIM), x, ctx.conv1d) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None
