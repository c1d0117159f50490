"""The collective kinds: one `Kind` per collective, registered once in `KINDS`.

A `Kind` describes one collective: what it computes (a sum of the ranks' tensors or their
concatenation; every rank holding the whole result, or its own rows of it), how it travels
(its plain transfer on a process group, its compressed pieces in `compressed`) and whether the
caller drives it one rank's part at a time (the per-rank kinds of the sequence-parallel overlap,
`call.Call.landed` / `call.Call.submit`). Every other concern reads these fields where it lives:
the result's shape and the input checks (here), the plain ring bytes of the statistics
(`stats.ring_bytes`), the emulated results (`emulated`, `stacked`), the custom op of a compiled
graph (`ops`: one op for every kind) and the kind's name in the agreement fingerprint
(`agreement.NAME_WORDS`).

Adding a collective is one `Kind` below, plus the functions it names: its pieces and piece
generator in `compressed` (emulated groups run them too, through an `emulated.EmulatedRank`
method for each new `dist_ops.Link` method they call) and its plain transfer here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from . import compressed
from .dist_ops import DONE


@dataclasses.dataclass(frozen=True)
class Kind:
    """What the code needs to know of one collective kind (module docstring).

    ``reduces``: the result sums the ranks' tensors (else it concatenates them along dim 0).
    ``scatters``: each rank keeps its own rows of the result (else every rank holds all of it, the
    same bytes: ``replicated``, which needs no exchange to agree on a flag, and an emulated group
    decodes once, for rank 0). ``in_place``: the result may be the input itself (an all-reduce's
    ``inplace=True``). ``pieces``: the compressed path's list of piece generators. ``plain``: the
    plain collective on a real group, ``(x, out, link) -> work`` (world > 1, non-finite values
    already handled; a per-rank kind's is its whole counterpart's, the float64 reference of a
    sampled call). ``per_rank``: the caller drives it one rank's part at a time, plain through
    `gather_by_rank_plain` or `scatter_by_rank_plain`.
    ``no_residual``: why the kind takes no error feedback (None: it takes a ``residual=``)."""

    name: str
    reduces: bool
    scatters: bool
    pieces: Callable
    plain: Callable
    per_rank: bool = False
    no_residual: str | None = None
    replicated: bool = dataclasses.field(init=False)  # every rank holds the result's bytes (not `scatters`)
    in_place: bool = dataclasses.field(init=False)  # the result may be the input itself (an all-reduce)

    def __post_init__(self) -> None:  # plain fields, not properties: read on every call
        object.__setattr__(self, "replicated", not self.scatters)
        object.__setattr__(self, "in_place", self.reduces and not self.scatters and not self.per_rank)

    def output_shape(self, shape, world: int) -> tuple[int, ...]:
        """This rank's result shape for an input of ``shape``."""
        if not self.reduces:
            return (shape[0] * world, *shape[1:])
        if self.scatters:
            return (shape[0] // world, *shape[1:])
        return tuple(shape)

    def check(self, x: torch.Tensor, world: int) -> None:
        """A ValueError naming the fix unless ``x`` has the rows the kind needs."""
        if self.scatters and (x.dim() == 0 or x.shape[0] % world):
            raise ValueError(
                f"{self.name} needs dim 0 of x (shape {list(x.shape)}) divisible by the group "
                f"size {world}; pad or trim dim 0 to a multiple of {world}"
            )
        if not self.reduces and x.dim() == 0:
            raise ValueError(f"{self.name} needs x with at least one dimension (got a 0-d tensor); use x.view(1)")


# --- the plain transfers on a real group (world > 1; non-finite values already handled) ---------


def _all_reduce(x: torch.Tensor, out: torch.Tensor, link):
    if out is not x:
        out.copy_(x)
    return link.all_reduce(out)


def _reduce_scatter(x: torch.Tensor, out: torch.Tensor, link):
    return link.reduce_scatter(out, x.contiguous())


def _all_gather(x: torch.Tensor, out: torch.Tensor, link):
    return link.all_gather(out, x.contiguous())


def gather_by_rank_plain(parts: list[torch.Tensor], link) -> Iterator[int]:
    """The plain all_gather_by_rank: ``parts[rank]`` holds this rank's x already; one broadcast
    per rank into ``parts``; yields each rank as its part lands (this rank's first)."""
    world, rank = link.world, link.rank
    works = [link.broadcast(parts[r], r) for r in range(world)] if world > 1 else [DONE]
    yield rank
    for r in (*range(rank), *range(rank + 1, world)):
        works[r].wait()
        yield r
    works[rank].wait()


def scatter_by_rank_plain(parts: list, link) -> Iterator[int]:
    """The plain reduce_scatter_by_rank: one reduction to rank r of ``parts[r]`` (the caller puts
    it there before step r; a reduction may overwrite it on every rank); yields each rank as its
    reduction is issued. This rank's sum is in ``parts[rank]`` once the generator ends."""
    world = link.world
    works = []
    for r in range(world):
        works.append(link.reduce(parts[r], r) if world > 1 else DONE)
        yield r
    for work in works:
        work.wait()


KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("all_reduce", reduces=True, scatters=False, pieces=compressed.all_reduce_pieces, plain=_all_reduce,
         no_residual="all_reduce takes no residual (the two-shot's second encoding, of the sum, is no rank's "
                     "input): for error feedback, reduce_scatter with residual= and then all_gather with residual="),
    Kind("reduce_scatter", reduces=True, scatters=True, pieces=compressed.reduce_scatter_pieces,
         plain=_reduce_scatter),
    Kind("all_gather", reduces=False, scatters=False, pieces=compressed.all_gather_pieces, plain=_all_gather),
    # the per-rank kinds of the sequence-parallel overlap: one piece each, a part per rank
    Kind("all_gather_by_rank", reduces=False, scatters=False,
         pieces=compressed.per_rank_pieces(compressed.all_gather_by_rank_piece), plain=_all_gather, per_rank=True,
         no_residual="the per-rank kinds take no residual"),
    Kind("reduce_scatter_by_rank", reduces=True, scatters=True,
         pieces=compressed.per_rank_pieces(compressed.reduce_scatter_by_rank_piece), plain=_reduce_scatter,
         per_rank=True, no_residual="the per-rank kinds take no residual"),
)}


def kind_of(name: str) -> Kind:
    """The `Kind` named ``name``; a ValueError naming the kinds otherwise."""
    found = KINDS.get(name)
    if found is None:
        raise ValueError(f"unknown collective {name!r}; the kinds are {sorted(KINDS)}")
    return found
