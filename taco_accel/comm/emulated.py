"""The collectives of a TP group emulated in one process: the same bytes, no torch.distributed.

An `EmulatedGroup` of P virtual ranks takes every rank's tensor as a list (index = rank) and
returns what the collectives of `collectives` return on a real group of P ranks::

    all_reduce(partials, config, site=)      -> the sum              (every rank holds these bytes)
    reduce_scatter(partials, config, site=)  -> [rank r's rows of the sum, for r in 0..P-1]
    all_gather(shards, config, site=)        -> the dim-0 concatenation (the same on every rank)

It takes the same decisions (plain below ``config.threshold_bytes``, pieces of
``config.piece_bytes``) and computes the same codec steps on the same inputs in the same order:
rank p's ``compress(x_p, chunks=P)``, then the sum over ranks 0..P-1 of every chunk r (what
the all-to-all delivers to rank r; one `sum_packed` over the whole buffers does all P at once,
group by group), then one decode of the gathered chunks. Given bit-identical inputs, the
outputs are bit-identical to a real group's (tests/test_comm.py checks every collective,
dtype and odd size for P = 2, 3, 4), so a model emulated on one device or a laptop trains with
the numerics of real compressed TP.

Statistics go to the same per-site counters (`stats`) with the figures one rank of a real
group would record: bytes that rank sends, and the ring bytes of the plain collective. The
plain path sums the partials in rank order in their dtype; a real backend may add them in
another order (for P > 2), which changes the result by fp32 (or bf16) rounding only.

``reducer`` replaces the compressed all-reduce with another codec, for ablations that are not
a `TacoConfig` (``taco_accel.bench.convergence``: naive per-tensor FP8); see `Reducer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..codec import Packed, TacoConfig, WireLayout, compress, decompress, sum_packed
from . import stats
from .collectives import check_rows, codec_config, nonfinite_error, plain_path, relative_error, zero_policy
from .compressed import pad_to_groups
from .pieces import piece_bounds, piece_length

Reducer = Callable[[Sequence[torch.Tensor], TacoConfig], tuple[torch.Tensor, int]]
"""``(partials, config) -> (sum, bytes one rank sends)``: a compressed all-reduce of P
same-shape, contiguous tensors (``config`` has ``nonfinite`` "propagate" or "zero")."""


def two_shot_all_reduce(partials: Sequence[torch.Tensor], config: TacoConfig) -> tuple[torch.Tensor, int]:
    """The TACO two-shot all-reduce of P partials, piece by piece; returns (sum, bytes per rank)."""
    world = len(partials)
    srcs = [p.view(-1) for p in partials]  # [n] each
    out = torch.empty_like(partials[0])
    dst = out.view(-1)
    step = piece_length(config.piece_bytes, partials[0].element_size(), world * config.group_size)
    sent = 0
    for a, b in piece_bounds(dst.numel(), step):
        sent += _all_reduce_piece([s[a:b] for s in srcs], dst[a:b], config)
    return out, sent


def _all_reduce_piece(srcs: list[torch.Tensor], out: torch.Tensor, cfg: TacoConfig) -> int:
    """out [n] <- compressed sum of srcs (P flat [n] pieces); returns the bytes one rank sends.

    Rank r sums chunk r of every peer's buffer; the sum is computed group by group, so one
    `sum_packed` over the P whole buffers yields every rank's summed chunk at once, already in
    the order the all-gather assembles (the same bytes as P sums over the single chunks)."""
    world = len(srcs)
    packed = [compress(src, cfg, chunks=world) for src in srcs]
    layout = packed[0].layout
    full = sum_packed(torch.stack([p.buffer for p in packed]), layout, cfg)  # [P * cb]: the all-gather
    decompress(Packed(full, srcs[0].shape, srcs[0].dtype, cfg, layout), out=out)
    return 2 * (world - 1) * layout.chunk_bytes


def _reduce_scatter_piece(blocks: list[torch.Tensor], outs: list[torch.Tensor], cfg: TacoConfig) -> int:
    """outs[r] [c] <- row r of the compressed sum of blocks (P tensors [P, c]); returns bytes per rank."""
    world = len(blocks)
    packed = [compress(pad_to_groups(b, cfg.group_size), cfg, chunks=world) for b in blocks]  # chunk r = block r
    layout = packed[0].layout
    summed = sum_packed(torch.stack([p.buffer for p in packed]), layout, cfg)  # chunk r: rank r's sum
    own = WireLayout.for_tensor(outs[0].numel(), cfg)
    for mine, out in zip(summed.view(world, layout.chunk_bytes), outs):
        decompress(Packed(mine, out.shape, out.dtype, cfg, own), out=out)
    return (world - 1) * layout.chunk_bytes


def _all_gather_piece(srcs: list[torch.Tensor], out: torch.Tensor, cfg: TacoConfig) -> int:
    """out [P, c] <- every rank's src [c], compressed and decoded; returns bytes per rank."""
    world, n = len(srcs), srcs[0].numel()
    packed = [compress(src, cfg) for src in srcs]  # one chunk each
    full = torch.cat([p.buffer for p in packed])  # [P * cb], rank order: what the all-gather delivers
    width = packed[0].layout.padded_numel
    layout = WireLayout.for_tensor(world * width, cfg, chunks=world)
    decoded = decompress(Packed(full, torch.Size((world, width)), out.dtype, cfg, layout))
    out.copy_(decoded[:, :n])
    return (world - 1) * packed[0].nbytes


class EmulatedGroup:
    """P virtual ranks in one process; every collective takes one tensor per rank (a list).

    ``reducer`` computes the compressed all-reduce (default: TACO's two-shot,
    `two_shot_all_reduce`); reduce_scatter and all_gather always use the TACO path.
    """

    def __init__(self, size: int, reducer: Reducer | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"EmulatedGroup(size={size!r}): use an int >= 1 (the tp degree)")
        self.size = size
        self.reducer = reducer or two_shot_all_reduce

    def __repr__(self) -> str:
        name = getattr(self.reducer, "__name__", repr(self.reducer))
        custom = "" if self.reducer is two_shot_all_reduce else f", reducer={name}"
        return f"EmulatedGroup(size={self.size}{custom})"

    def all_reduce(
        self, partials: Sequence[torch.Tensor], config: TacoConfig | None = None, *, site: str | None = None
    ) -> torch.Tensor:
        """The sum of every rank's tensor: a new tensor of their shape and dtype."""
        xs = self._check("all_reduce", partials)
        return self._run("all_reduce", xs, config, site or "all_reduce")

    def reduce_scatter(
        self, partials: Sequence[torch.Tensor], config: TacoConfig | None = None, *, site: str | None = None
    ) -> list[torch.Tensor]:
        """Each tensor has P*m rows along dim 0; returns ``[rank r's m rows of the sum]``."""
        xs = self._check("reduce_scatter", partials)
        check_rows(xs[0], self.size)
        summed = self._run("reduce_scatter", xs, config, site or "reduce_scatter")
        return list(summed.chunk(self.size))

    def all_gather(
        self, shards: Sequence[torch.Tensor], config: TacoConfig | None = None, *, site: str | None = None
    ) -> torch.Tensor:
        """Concatenation of every rank's tensor along dim 0, in rank order."""
        xs = self._check("all_gather", shards)
        check_rows(xs[0])
        return self._run("all_gather", xs, config, site or "all_gather")

    # -- shared steps -----------------------------------------------------------------------

    def _check(self, kind: str, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(xs) != self.size or not all(isinstance(x, torch.Tensor) for x in xs):
            raise ValueError(
                f"{kind} on an EmulatedGroup of {self.size} ranks needs {self.size} tensors, got {len(xs)}"
            )
        first = xs[0]
        if any(x.shape != first.shape or x.dtype != first.dtype or x.device != first.device for x in xs):
            raise ValueError(f"{kind}: every rank's tensor must have one shape, dtype and device")
        return [x.detach().contiguous() for x in xs]

    def _run(self, kind: str, xs: list[torch.Tensor], config: TacoConfig | None, site: str) -> torch.Tensor:
        """The collective ``kind``, plain or compressed, as a tensor (reduce_scatter: all ranks'
        rows stacked in rank order); records the site's statistics like one rank would."""
        nbytes = xs[0].numel() * xs[0].element_size()
        plain = stats.plain_bytes(kind, nbytes, self.size)
        if plain_path(config, nbytes, self.size):
            out = _plain(kind, [zero_policy(x, config) for x in xs])
            stats.record(site, sent=plain, uncompressed=plain, compressed=False)
        else:
            out, sent = self._compressed(kind, xs, codec_config(config))
            stats.record(site, sent=sent, uncompressed=plain, compressed=True)
            if stats.should_sample(site):
                stats.record_error(site, relative_error(out, _plain(kind, [x.double() for x in xs])))
        if config is not None and config.nonfinite == "raise" and not bool(torch.isfinite(out).all()):
            raise nonfinite_error(site)
        return out

    def _compressed(self, kind: str, xs: list[torch.Tensor], cfg: TacoConfig) -> tuple[torch.Tensor, int]:
        if kind == "all_reduce":
            return self.reducer(xs, cfg)
        world, size = self.size, xs[0].element_size()
        if kind == "reduce_scatter":
            blocks = [x.view(world, -1) for x in xs]  # [P, k]: row r holds the rows of rank r
            out = torch.empty_like(xs[0])
            rows = out.view(world, -1)
            step = piece_length(cfg.piece_bytes, world * size, cfg.group_size)
            sent = sum(
                _reduce_scatter_piece([blk[:, a:b] for blk in blocks], list(rows[:, a:b].unbind(0)), cfg)
                for a, b in piece_bounds(rows.shape[1], step)
            )
            return out, sent
        srcs = [x.view(-1) for x in xs]  # [k] each
        out = xs[0].new_empty((world * xs[0].shape[0], *xs[0].shape[1:]))
        blocks = out.view(world, -1)  # [P, k]: row p holds rank p's tensor
        step = piece_length(cfg.piece_bytes, size, cfg.group_size)
        sent = sum(
            _all_gather_piece([s[a:b] for s in srcs], blocks[:, a:b], cfg)
            for a, b in piece_bounds(srcs[0].numel(), step)
        )
        return out, sent


def _plain(kind: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The plain collective in the inputs' dtype (sums in rank order)."""
    if kind == "all_gather":
        return torch.cat(xs)
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out
