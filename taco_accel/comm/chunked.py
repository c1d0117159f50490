"""All-gather and reduce-scatter cut into one message per rank, so that compute follows each one.

The decomposition of PyTorch's async TP and of Megatron's TP communication overlap, written with
plain torch.distributed async collectives (so it runs on gloo as on NCCL)::

    parts = GatherChunks(x, group, config, site="...")   # all-gather of x: one broadcast per rank
    for rank, part in parts:                             # own part first, then in rank order
        out[rank] = part @ w                             # computes while the next part travels
    parts.finish()                                       # statistics; nonfinite="raise" check

    sums = ScatterChunks(group, config, site="...")      # reduce-scatter: one reduction per rank
    for rank in range(P):
        sums.submit(rank, partial_for(rank))             # computed, then sent while the next computes
    mine = sums.wait()                                   # the sum over ranks of this rank's part

Every rank must issue the same calls in the same order. Results equal `all_gather` /
`reduce_scatter` of the rank blocks (``x.unsqueeze(0)``; the partials stacked): compressed,
the same bytes (each rank's part is coded as one buffer of whole groups, as the pieces of the
one-shot path are, and the received buffers are summed in rank order by `sum_packed`); plain,
the all-gather bit for bit and the reduce-scatter up to the order of the fp32 additions for
P > 2. Statistics are recorded under ``site`` as one call of the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec import Packed, TacoConfig, WireLayout, compress, decompress, sum_packed
from . import agreement, stats
from .collectives import codec_config, plain_path, raise_if_flag, zero_policy


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class GatherChunks:
    """Every rank's ``x`` (same shape on every rank), one async broadcast each; iterate to get
    ``(rank, part)`` as they land: this rank's first, then the others in rank order."""

    def __init__(self, x: torch.Tensor, group, config: TacoConfig | None, site: str = "all_gather") -> None:
        x = x.detach().contiguous()
        self.group, self.config, self.site = group, config, site
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.nbytes = x.numel() * x.element_size()
        self.compressed = not plain_path(config, self.nbytes, self.world)
        if self.compressed:
            self.cfg = codec_config(config)
            packed = compress(x, self.cfg)  # one buffer of whole groups: the pieces' groups
            self.shape, self.dtype, self.layout = x.shape, x.dtype, packed.layout
            own = packed.buffer
        else:
            own = zero_policy(x, config)
        if agreement.due(site):  # before any byte moves, as the whole collectives do
            agreement.check("all_gather", x, group, config, self.compressed, site, self.world)
        self.buffers = [own if r == self.rank else torch.empty_like(own) for r in range(self.world)]
        self.works = [dist.broadcast(self.buffers[r], _global(group, r), group=group, async_op=True)
                      for r in range(self.world)]
        self.parts: list[torch.Tensor | None] = [None] * self.world

    def __iter__(self):
        for r in [self.rank, *(r for r in range(self.world) if r != self.rank)]:
            if r != self.rank:  # this rank's part is here already; its broadcast is awaited in `finish`
                with agreement.named_timeouts(self.site, "all_gather (per rank)", self.group):
                    self.works[r].wait()
            if self.compressed:  # this rank's part is decoded too: every rank holds the same bytes
                part = decompress(Packed(self.buffers[r], self.shape, self.dtype, self.cfg, self.layout))
            else:
                part = self.buffers[r]
            self.parts[r] = part
            yield r, part

    def finish(self) -> list[torch.Tensor]:
        """Every rank's part (iterating first if needed); records the call, checks "raise"."""
        if any(p is None for p in self.parts):
            for _ in self:
                pass
        with agreement.named_timeouts(self.site, "all_gather (per rank)", self.group):
            self.works[self.rank].wait()
        if self.compressed:
            sent = (self.world - 1) * self.layout.total_bytes
            checked = [self.layout.scales(b) for b in self.buffers]  # a non-finite group has a NaN scale
        else:
            sent = stats.plain_bytes("all_gather", self.nbytes, self.world)
            checked = self.parts if self.parts[0].is_floating_point() else []
        flag = torch.stack([~torch.isfinite(t).all() for t in checked]).any() if checked else None
        stats.record(self.site, sent=sent, uncompressed=stats.plain_bytes("all_gather", self.nbytes, self.world),
                     compressed=self.compressed)
        if self.config is not None and self.config.nonfinite == "raise" and flag is not None:
            raise_if_flag(flag, self.group, self.world, self.site, agree=False)  # the same bytes everywhere
        return self.parts


class ScatterChunks:
    """Reduce-scatter, one reduction per destination rank: `submit` rank r's partial (every rank,
    r = 0..P-1 in order, same shape; not modified unless ``owned``), `wait` for the sum of this
    rank's partials."""

    def __init__(self, group, config: TacoConfig | None, site: str = "reduce_scatter") -> None:
        self.group, self.config, self.site = group, config, site
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.works, self.keep = [], []
        self.compressed: bool | None = None
        self.mine: torch.Tensor | None = None
        self.received: list[torch.Tensor] = []

    def submit(self, rank: int, part: torch.Tensor, owned: bool = False) -> None:
        """Send this rank's ``part`` of rank ``rank``'s rows; ``owned``: the caller gives ``part``
        away (a temporary), so the plain reduction may work in it instead of a copy."""
        part = part.detach().contiguous()
        if self.compressed is None:  # the whole input is P such parts
            self.nbytes = self.world * part.numel() * part.element_size()
            self.compressed = not plain_path(self.config, self.nbytes, self.world)
            self.shape, self.dtype = part.shape, part.dtype
            if agreement.due(self.site):
                agreement.check("reduce_scatter", part, self.group, self.config, self.compressed, self.site,
                                self.world)
        dst = _global(self.group, rank)
        if self.compressed:
            buffer = compress(part, codec_config(self.config)).buffer
            gather = None
            if rank == self.rank:  # this rank receives every rank's buffer of its part
                self.received = gather = [torch.empty_like(buffer) for _ in range(self.world)]
            self.works.append(dist.gather(buffer, gather, dst, group=self.group, async_op=True))
            self.keep.append(buffer)
        else:
            reduced = zero_policy(part, self.config)
            if reduced.data_ptr() == part.data_ptr() and not owned:  # the reduction works in place
                reduced = part.clone()
            part = reduced
            self.works.append(dist.reduce(part, dst, group=self.group, async_op=True))
            self.keep.append(part)
            if rank == self.rank:
                self.mine = part  # reduced in place on this rank

    def wait(self) -> torch.Tensor:
        with agreement.named_timeouts(self.site, "reduce_scatter (per rank)", self.group):
            for work in self.works:
                work.wait()
        if self.compressed:
            cfg = codec_config(self.config)
            own = WireLayout.for_tensor(self.shape.numel(), cfg)
            summed = sum_packed(torch.stack(self.received), WireLayout.for_tensor(own.padded_numel, cfg), cfg)
            out = decompress(Packed(summed, self.shape, self.dtype, cfg, own))
            sent, flag = (self.world - 1) * own.total_bytes, ~torch.isfinite(own.scales(summed)).all()
        else:
            out = self.mine
            sent = stats.plain_bytes("reduce_scatter", self.nbytes, self.world)
            flag = ~torch.isfinite(out).all() if out.is_floating_point() else None
        stats.record(self.site, sent=sent, uncompressed=stats.plain_bytes("reduce_scatter", self.nbytes, self.world),
                     compressed=self.compressed)
        if self.config is not None and self.config.nonfinite == "raise" and flag is not None:
            raise_if_flag(flag, self.group, self.world, self.site, agree=True)  # each rank holds other sums
        return out
