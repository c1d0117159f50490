"""The collective kinds: one `Kind` per collective, registered once in `KINDS`.

Every table that used to be keyed by a kind's name reads its entry here: the result's shape and
the input checks (`collectives`, `site`, `emulated`), the bytes of the plain ring collective
(`stats` figures), the piece generator of the compressed path (`compressed`, run by real and
emulated groups alike), the plain collective on a real link and on an emulated group, the
stacked road of an emulated message of one piece (`stacked`), the custom op a compiled graph
calls (`ops`), and the code of the kind in the agreement check's fingerprint (its index here).

Adding a collective is one `Kind` below (plus the functions it names: a piece generator in
`compressed`, and a `dist_ops.Link` method with its `emulated.EmulatedRank` counterpart if the
generator or the plain collective calls a new one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import compressed, ops, stacked
from .pieces import piece_bounds, piece_length


# --- output shapes and checks ------------------------------------------------------------------


def _same_shape(shape, world: int) -> tuple[int, ...]:
    return tuple(shape)


def _rows_divided(shape, world: int) -> tuple[int, ...]:
    return (shape[0] // world, *shape[1:])


def _rows_multiplied(shape, world: int) -> tuple[int, ...]:
    return (shape[0] * world, *shape[1:])


def _any_shape(name: str, x: torch.Tensor, world: int) -> None:
    """Every shape is accepted."""


def _needs_rows(name: str, x: torch.Tensor, world: int) -> None:
    """A dim 0 to gather along."""
    if x.dim() == 0:
        raise ValueError(f"{name} needs x with at least one dimension (got a 0-d tensor); use x.view(1)")


def _rows_divisible(name: str, x: torch.Tensor, world: int) -> None:
    """Dim 0 divisible by the group size (one row block per rank)."""
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(
            f"{name} needs dim 0 of x (shape {list(x.shape)}) divisible by the group "
            f"size {world}; pad or trim dim 0 to a multiple of {world}"
        )


# --- bytes one rank sends in the bandwidth-optimal (ring) plain collective ----------------------
# ``nbytes`` is the size of this rank's input.


def _ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def _ring_reduce_scatter_bytes(nbytes: int, world: int) -> int:
    return (world - 1) * nbytes // world  # the input holds P blocks


def _ring_all_gather_bytes(nbytes: int, world: int) -> int:
    return (world - 1) * nbytes


# --- the plain collective on a real link (world > 1; non-finite values already handled) --------


def _link_all_reduce(x: torch.Tensor, out: torch.Tensor, link):
    if out is not x:
        out.copy_(x)
    return link.all_reduce(out)


def _link_reduce_scatter(x: torch.Tensor, out: torch.Tensor, link):
    return link.reduce_scatter(out, x.contiguous())


def _link_all_gather(x: torch.Tensor, out: torch.Tensor, link):
    return link.all_gather(out, x.contiguous())


# --- the plain collective of an emulated group: every rank's tensor, in its dtype ---------------


def _sum_in_rank_order(xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out


def _concatenate(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(xs)


# --- whether `compressed` sends x in one piece (an emulated group's `stacked` road) -------------


def _all_reduce_one_piece(x: torch.Tensor, codec, piece_bytes: int, world: int) -> bool:
    step = piece_length(piece_bytes, x.element_size(), world * codec.group_size)
    return len(piece_bounds(x.numel(), step)) == 1


def _reduce_scatter_one_piece(x: torch.Tensor, codec, piece_bytes: int, world: int) -> bool:
    step = piece_length(piece_bytes, world * x.element_size(), codec.group_size)
    return len(piece_bounds(x.numel() // world, step)) == 1


def _all_gather_one_piece(x: torch.Tensor, codec, piece_bytes: int, world: int) -> bool:
    step = piece_length(piece_bytes, x.element_size(), codec.group_size)
    return len(piece_bounds(x.numel(), step)) == 1


# --- the custom ops of a compiled graph (`ops`): (x, site handle, world) -> result --------------


def _all_reduce_op(x: torch.Tensor, handle: int, world: int) -> torch.Tensor:
    return torch.ops.taco.all_reduce(x, handle)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What the code needs to know of one collective kind.

    ``same_bytes``: every rank holds the result's bytes (no exchange to agree on a "raise" flag;
    an emulated group decodes them once, on rank 0); otherwise each rank holds its own rows.
    ``in_place``: the result may be the input itself (``inplace=True``). ``no_residual``: why
    the kind takes no error feedback (None: it takes a ``residual=``). ``stacked`` and
    ``one_piece``: the emulated road of a message of one piece (None: the pieces only). ``op``:
    the custom op a compiled graph calls (None: not callable from a compiled graph)."""

    name: str
    output_shape: Callable[..., tuple]        # (input shape, world) -> this rank's result shape
    check_shape: Callable[..., None]          # (name, x, world): a ValueError naming the fix
    plain_bytes: Callable[[int, int], int]    # (input bytes, world) -> bytes of the plain ring collective
    pieces: Callable                          # the piece generator of the compressed path (`compressed`)
    plain: Callable                           # (x, out, link) -> work: the plain collective, world > 1
    emulated_plain: Callable                  # (every rank's x) -> the plain result, in x's dtype
    same_bytes: bool
    in_place: bool = False
    no_residual: str | None = None
    stacked: Callable | None = None
    one_piece: Callable | None = None
    op: Callable | None = None

    def check(self, x: torch.Tensor, world: int) -> None:
        self.check_shape(self.name, x, world)


def _register(*kinds: Kind) -> dict[str, Kind]:
    return {kind.name: kind for kind in kinds}


KINDS: dict[str, Kind] = _register(
    Kind("all_reduce", _same_shape, _any_shape, _ring_all_reduce_bytes, compressed.all_reduce_pieces,
         _link_all_reduce, _sum_in_rank_order, same_bytes=True, in_place=True,
         no_residual="all_reduce takes no residual (the two-shot's second encoding, of the sum, is no rank's "
                     "input): for error feedback, reduce_scatter with residual= and then all_gather with residual=",
         stacked=stacked.all_reduce, one_piece=_all_reduce_one_piece, op=_all_reduce_op),
    Kind("reduce_scatter", _rows_divided, _rows_divisible, _ring_reduce_scatter_bytes,
         compressed.reduce_scatter_pieces, _link_reduce_scatter, _sum_in_rank_order, same_bytes=False,
         stacked=stacked.reduce_scatter, one_piece=_reduce_scatter_one_piece, op=ops.reduce_scatter),
    Kind("all_gather", _rows_multiplied, _needs_rows, _ring_all_gather_bytes, compressed.all_gather_pieces,
         _link_all_gather, _concatenate, same_bytes=True,
         stacked=stacked.all_gather, one_piece=_all_gather_one_piece, op=ops.all_gather),
    # the per-rank kinds (`collectives.GatherByRank`, `collectives.ScatterByRank`): one piece each
    Kind("all_gather_by_rank", _rows_multiplied, _needs_rows, _ring_all_gather_bytes,
         compressed.all_gather_by_rank_pieces, _link_all_gather, _concatenate, same_bytes=True),
    Kind("reduce_scatter_by_rank", _rows_divided, _rows_divisible, _ring_reduce_scatter_bytes,
         compressed.reduce_scatter_by_rank_pieces, _link_reduce_scatter, _sum_in_rank_order, same_bytes=False),
)


def kind_of(name: str) -> Kind:
    """The `Kind` named ``name``; a ValueError naming the kinds otherwise."""
    found = KINDS.get(name)
    if found is None:
        raise ValueError(f"unknown collective {name!r}; the kinds are {sorted(KINDS)}")
    return found
