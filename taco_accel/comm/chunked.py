"""All-gather and reduce-scatter cut into one message per rank, so that compute follows each one.

The decomposition of PyTorch's async TP and of Megatron's TP communication overlap, written with
plain torch.distributed async collectives (so it runs on gloo as on NCCL)::

    parts = GatherChunks(x, site, out=full)      # all-gather of x: one broadcast per rank, into full
    for rank, part in parts:                     # own part first, then in rank order
        y[rank] = part @ w                       # computes while the next part travels
    parts.finish()                               # statistics; nonfinite="raise" check

    sums = ScatterChunks(site, part_shape, dtype, device)   # reduce-scatter: one reduction per rank
    for rank in range(P):
        sums.submit(rank, partial_for(rank))     # computed, then sent while the next computes
    mine = sums.wait()                           # the sum over ranks of this rank's part

``site`` is the `site.Site` whose settings, decision and statistics the call uses. Every rank
must issue the same calls in the same order. Results equal `all_gather` / `reduce_scatter` of
the rank blocks (``x.unsqueeze(0)``; the partials stacked): compressed, the same bytes (each
rank's part is coded as one buffer of whole groups, as the pieces of the one-shot path are, and
the received buffers are summed in rank order by `sum_packed`); plain, the all-gather bit for
bit and the reduce-scatter up to the order of the fp32 additions for P > 2. Statistics are
recorded under the site as one call of the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec import Packed, WireLayout, compress, decompress, sum_packed
from . import agreement
from .collectives import raise_if_flag, wire_codec
from .stats import plain_bytes


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _zeroed(x: torch.Tensor, codec, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with NaN / Inf as 0 under ``nonfinite="zero"`` (into ``out`` if given), else ``x``."""
    if codec is not None and codec.nonfinite == "zero" and x.is_floating_point():
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)
    if out is not None:
        out.copy_(x)
        return out
    return x


class GatherChunks:
    """Every rank's ``x`` (same shape on every rank), one async broadcast each, received into
    ``out`` (contiguous, ``P * x.numel()`` values: part r is the r-th block of its memory; a new
    ``(P, *x.shape)`` tensor if None); iterate to get ``(rank, part)`` as they land: this rank's
    first, then the others in rank order. Each part is a view of ``out`` of x's shape."""

    def __init__(self, x: torch.Tensor, site, out: torch.Tensor | None = None) -> None:
        x = x.detach().contiguous()
        link = site.link
        self.site, self.group, self.world, self.rank = site, link.group, link.world, link.rank
        self.nbytes = x.numel() * x.element_size()
        self.compressed = site.compresses("all_gather", x) and self.world > 1
        if agreement.due(site.entry):  # before any byte moves, as the whole collectives do
            agreement.check("all_gather", x, link, site.codec, self.compressed, site.name, site.piece_bytes)
        if out is None:
            out = x.new_empty((self.world, *x.shape))
        self.out = out
        self.parts = [block.view(x.shape) for block in out.view(self.world, -1)]
        if self.compressed:
            self.codec = wire_codec(site.codec)
            packed = compress(x, self.codec)  # one buffer of whole groups: the pieces' groups
            self.layout, own = packed.layout, packed.buffer
            self.buffers = [own if r == self.rank else torch.empty_like(own) for r in range(self.world)]
        else:
            _zeroed(x, site.codec, out=self.parts[self.rank])
            self.buffers = self.parts
        self.works = [dist.broadcast(self.buffers[r], _global(self.group, r), group=self.group, async_op=True)
                      for r in range(self.world)]
        self._landed = [False] * self.world

    def __iter__(self):
        for r in [self.rank, *(r for r in range(self.world) if r != self.rank)]:
            if r != self.rank:  # this rank's part is here already; its broadcast is awaited in `finish`
                with agreement.named_timeouts(self.site.name, "all_gather (per rank)", self.group):
                    self.works[r].wait()
            if self.compressed:  # this rank's part is decoded too: every rank holds the same bytes
                part = self.parts[r]
                decompress(Packed(self.buffers[r], part.shape, part.dtype, self.codec, self.layout), out=part)
            self._landed[r] = True
            yield r, self.parts[r]

    def finish(self) -> torch.Tensor:
        """``out``, every part landed (iterating first if needed); records the call, checks "raise"."""
        if not all(self._landed):
            for _ in self:
                pass
        with agreement.named_timeouts(self.site.name, "all_gather (per rank)", self.group):
            self.works[self.rank].wait()
        uncompressed = plain_bytes("all_gather", self.nbytes, self.world)
        sent = (self.world - 1) * self.layout.total_bytes if self.compressed else uncompressed
        self.site.entry.add(sent, uncompressed, self.compressed)
        codec = self.site.codec
        if codec is not None and codec.nonfinite == "raise" and self.out.is_floating_point():
            if self.compressed:  # a non-finite group has a NaN scale
                flag = torch.stack([~torch.isfinite(self.layout.scales(b)).all() for b in self.buffers]).any()
            else:
                flag = ~torch.isfinite(self.out).all()
            raise_if_flag(flag, self.site.link, self.site.name, agree=False)  # the same bytes everywhere
        return self.out


class ScatterChunks:
    """Reduce-scatter, one reduction per destination rank: `submit` rank r's partial (every rank,
    r = 0..P-1 in order, of ``shape`` and ``dtype``; not modified unless ``owned``), `wait` for
    the sum of this rank's partials."""

    def __init__(self, site, shape, dtype: torch.dtype, device) -> None:
        link = site.link
        self.site, self.group, self.world, self.rank = site, link.group, link.world, link.rank
        self.shape, self.dtype = torch.Size(shape), dtype
        self.nbytes = self.world * self.shape.numel() * dtype.itemsize  # the whole input: P parts
        self.compressed = site.compresses_like("reduce_scatter", (self.world, *shape), dtype, device) and self.world > 1
        self.codec = wire_codec(site.codec) if self.compressed else site.codec
        self.works, self.keep, self.received = [], [], []
        self.mine: torch.Tensor | None = None
        self._checked = False

    def submit(self, rank: int, part: torch.Tensor, owned: bool = False) -> None:
        """Send this rank's ``part`` of rank ``rank``'s rows; ``owned``: the caller gives ``part``
        away (a temporary), so the plain reduction may work in it instead of a copy."""
        part = part.detach().contiguous()
        site = self.site
        if not self._checked:
            self._checked = True
            if agreement.due(site.entry):
                agreement.check("reduce_scatter", part, site.link, site.codec, self.compressed, site.name,
                                site.piece_bytes)
        dst = _global(self.group, rank)
        if self.compressed:
            buffer = compress(part, self.codec).buffer
            gather = None
            if rank == self.rank:  # this rank receives every rank's buffer of its part
                self.received = gather = [torch.empty_like(buffer) for _ in range(self.world)]
            self.works.append(dist.gather(buffer, gather, dst, group=self.group, async_op=True))
            self.keep.append(buffer)
        else:
            reduced = _zeroed(part, site.codec)
            if reduced.data_ptr() == part.data_ptr() and not owned:  # the reduction works in place
                reduced = part.clone()
            self.works.append(dist.reduce(reduced, dst, group=self.group, async_op=True))
            self.keep.append(reduced)
            if rank == self.rank:
                self.mine = reduced  # reduced in place on this rank

    def wait(self) -> torch.Tensor:
        with agreement.named_timeouts(self.site.name, "reduce_scatter (per rank)", self.group):
            for work in self.works:
                work.wait()
        uncompressed = plain_bytes("reduce_scatter", self.nbytes, self.world)
        if self.compressed:
            own = WireLayout.for_tensor(self.shape.numel(), self.codec)
            summed = sum_packed(torch.stack(self.received), WireLayout.for_tensor(own.padded_numel, self.codec),
                                self.codec)
            out = decompress(Packed(summed, self.shape, self.dtype, self.codec, own))
            sent = (self.world - 1) * own.total_bytes
        else:
            out, sent = self.mine, uncompressed
        self.site.entry.add(sent, uncompressed, self.compressed)
        codec = self.site.codec
        if codec is not None and codec.nonfinite == "raise" and out.is_floating_point():
            flag = ~torch.isfinite(own.scales(summed)).all() if self.compressed else ~torch.isfinite(out).all()
            raise_if_flag(flag, self.site.link, self.site.name, agree=True)  # each rank holds other sums
        return out
