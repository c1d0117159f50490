"""The compressed collectives of TACO_SPEC.md, one piece at a time.

Each function here is a generator over one piece of a message (see `pieces`): codec work,
then an asynchronous collective, ``yield``, wait, and so on. Notation: P ranks, G values per
group, ``cb`` bytes per chunk (`WireLayout.chunk_bytes`).

- all_reduce (two-shot): compress as P chunks, all-to-all (rank r receives chunk r of every
  peer), `sum_packed` (dequantise, fp32 sum, requantise in the transformed domain),
  all-gather of the reduced chunks, decode. Every rank decodes the same bytes, so every rank
  gets a bit-identical result.
- reduce_scatter: the input is P row blocks; each block is padded to whole groups and
  compressed as its own chunk, so chunk r is exactly the rows of rank r; then all-to-all,
  `sum_packed`, decode the own chunk.
- all_gather: compress, all-gather the buffers, decode all of them as one P-chunk buffer.

Group boundaries depend only on the position inside a piece, and pieces are cut at multiples
of P*G (all_reduce) or G (per block), so a piece boundary is always a group boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..codec import Packed, TacoConfig, WireLayout, compress, decompress, sum_packed
from .dist_ops import all_gather_into, all_to_all
from .pieces import piece_bounds, piece_length


@dataclass
class Tally:
    """What the pieces of one call report: bytes sent, and (if asked) non-finite flags."""

    check_nonfinite: bool = False
    sent: int = 0
    flags: list = field(default_factory=list)  # 0-d bool tensors, one per checked buffer

    def note(self, layout: WireLayout, buffer: torch.Tensor) -> None:
        """Remember whether the scales of ``buffer`` hold a NaN (a non-finite group) when checking is on."""
        if self.check_nonfinite:
            self.flags.append(~torch.isfinite(layout.scales(buffer)).all())

    def any_nonfinite(self) -> torch.Tensor:
        """0-d bool tensor: some checked buffer had a non-finite group (no host sync)."""
        return torch.stack(self.flags).any()


class Workspace:
    """Receive buffers reused from call to call instead of fresh allocations (two per piece).

    One per device, shared by every call site: collectives of a model run one after another,
    and a call holds the workspace from its start to its result (`acquire` / `release`; a
    second call in flight meanwhile, or a CUDA graph capture, gets fresh buffers instead). A
    piece uses slot ``index % 3``: at most three pieces are in flight (`pieces`). Each buffer
    grows to the largest message seen and stays; `release_workspaces` frees them. Reuse is safe
    on NCCL: a collective's stream waits for the work queued before it, which includes the
    previous call's reads of the same buffer.
    """

    SLOTS = 3

    def __init__(self) -> None:
        self.busy = False
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def buffer(self, role: str, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (role, slot % self.SLOTS)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


class FreshBuffers:
    """`Workspace`'s interface, allocating every time."""

    def buffer(self, role: str, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


_workspaces: dict[torch.device, Workspace] = {}


def acquire(device: torch.device) -> Workspace | FreshBuffers:
    """The device's workspace if it is free (and no CUDA graph is being captured), else fresh buffers."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return FreshBuffers()  # a captured graph must own its buffers (the graph's memory pool)
    workspace = _workspaces.get(device)
    if workspace is None:
        workspace = _workspaces[device] = Workspace()
    if workspace.busy:
        return FreshBuffers()
    workspace.busy = True
    return workspace


def release(buffers: Workspace | FreshBuffers) -> None:
    if isinstance(buffers, Workspace):
        buffers.busy = False


def release_workspaces() -> None:
    """Free every workspace (they grow to the largest message and stay otherwise)."""
    _workspaces.clear()


def pad_to_groups(blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P, c] -> [P, ceil(c/G)*G], zero-padded on the right (no copy when c is a multiple of G)."""
    world, cols = blocks.shape
    width = -(-cols // group_size) * group_size
    if width == cols:
        return blocks
    padded = blocks.new_zeros(world, width)
    padded[:, :cols] = blocks
    return padded


def all_reduce_piece(
    src: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally, buffers, slot: int
) -> Iterator:
    """out [n] <- compressed two-shot sum over the ranks of src [n] (both flat, contiguous)."""
    packed = compress(src, cfg, chunks=world)
    layout = packed.layout
    recv = buffers.buffer("recv", slot, packed.nbytes, src.device)  # [P * cb]: chunk `rank` of every peer
    work = all_to_all(recv, packed.buffer, group)
    yield
    work.wait()
    mine = sum_packed(recv.view(world, layout.chunk_bytes), layout.chunk_layout(), cfg)  # [cb]
    full = buffers.buffer("full", slot, packed.nbytes, src.device)  # [P * cb]: every reduced chunk, rank order
    work = all_gather_into(full, mine, group)
    yield
    work.wait()
    tally.sent += 2 * (world - 1) * layout.chunk_bytes
    tally.note(layout, full)
    decompress(Packed(full, src.shape, src.dtype, cfg, layout), out=out)


def reduce_scatter_piece(
    blocks: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally, buffers, slot: int
) -> Iterator:
    """out [c] <- this rank's row of the compressed sum over ranks of blocks [P, c]."""
    packed = compress(pad_to_groups(blocks, cfg.group_size), cfg, chunks=world)  # chunk r = block r
    layout = packed.layout
    recv = buffers.buffer("recv", slot, packed.nbytes, blocks.device)  # [P * cb]
    work = all_to_all(recv, packed.buffer, group)
    yield
    work.wait()
    mine = sum_packed(recv.view(world, layout.chunk_bytes), layout.chunk_layout(), cfg)  # [cb]
    own = WireLayout.for_tensor(out.numel(), cfg)
    assert own.total_bytes == mine.numel(), (own, mine.numel())
    tally.sent += (world - 1) * layout.chunk_bytes
    tally.note(own, mine)
    decompress(Packed(mine, out.shape, out.dtype, cfg, own), out=out)


def all_gather_piece(
    src: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally, buffers, slot: int
) -> Iterator:
    """out [P, c] (may be a strided view) <- every rank's src [c] decoded, in rank order."""
    packed = compress(src, cfg)  # one chunk of gpc = ceil(c/G) groups
    full = buffers.buffer("full", slot, world * packed.nbytes, src.device)  # [P * cb]
    work = all_gather_into(full, packed.buffer, group)
    yield
    work.wait()
    width = packed.layout.padded_numel  # gpc * G
    layout = WireLayout.for_tensor(world * width, cfg, chunks=world)  # chunk p = rank p's buffer
    assert layout.total_bytes == full.numel(), (layout, full.numel())
    tally.sent += (world - 1) * packed.nbytes
    tally.note(layout, full)
    if width == src.numel() and out.is_contiguous():
        decompress(Packed(full, out.shape, out.dtype, cfg, layout), out=out)
    else:
        decoded = decompress(Packed(full, torch.Size((world, width)), out.dtype, cfg, layout))
        out.copy_(decoded[:, : src.numel()])


# --- one call as pieces: views of the input and output, cut at group boundaries --------------


def all_reduce_pieces(x: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally, buffers):
    """The pieces of a compressed all_reduce of x into out (same shape, both contiguous)."""
    src, dst = x.view(-1), out.view(-1)  # [n]
    step = piece_length(cfg.piece_bytes, x.element_size(), world * cfg.group_size)
    for slot, (a, b) in enumerate(piece_bounds(src.numel(), step)):
        yield all_reduce_piece(src[a:b], dst[a:b], cfg, group, world, tally, buffers, slot)


def reduce_scatter_pieces(x: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally,
                          buffers):
    """The pieces of a compressed reduce_scatter of x [P*m, ...] into out [m, ...] (contiguous)."""
    blocks, dst = x.view(world, -1), out.view(-1)  # [P, k] (row r: the rows of rank r), [k]
    step = piece_length(cfg.piece_bytes, world * x.element_size(), cfg.group_size)
    for slot, (a, b) in enumerate(piece_bounds(dst.numel(), step)):
        yield reduce_scatter_piece(blocks[:, a:b], dst[a:b], cfg, group, world, tally, buffers, slot)


def all_gather_pieces(x: torch.Tensor, out: torch.Tensor, cfg: TacoConfig, group, world: int, tally: Tally, buffers):
    """The pieces of a compressed all_gather of x [m, ...] into out [P*m, ...] (contiguous)."""
    src, blocks = x.view(-1), out.view(world, -1)  # [k], [P, k] (row p: rank p's x)
    step = piece_length(cfg.piece_bytes, x.element_size(), cfg.group_size)
    for slot, (a, b) in enumerate(piece_bounds(src.numel(), step)):
        yield all_gather_piece(src[a:b], blocks[:, a:b], cfg, group, world, tally, buffers, slot)
