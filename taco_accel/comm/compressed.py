"""The compressed collectives of TACO, one piece at a time: the one implementation that real
groups and emulated ones (`emulated`) both run.

Each function here is a generator over one piece of a message for one rank (see `pieces`):
codec work, then an asynchronous collective on ``link``, ``yield``, wait, and so on. ``link``
is a `dist_ops.Link` (a real process group) or one virtual rank of an `emulated.EmulatedGroup`;
both offer ``world``, ``all_to_all(out, x)`` and ``all_gather(out, x)``. Notation: P ranks, G
values per group, ``cb`` bytes per chunk (`WireLayout.chunk_bytes`).

- all_reduce (two-shot): compress as P chunks, all-to-all (rank r receives chunk r of every
  peer), `sum_packed` (dequantise, fp32 sum, requantise in the transformed domain),
  all-gather of the reduced chunks, decode. Every rank decodes the same bytes, so every rank
  gets a bit-identical result.
- reduce_scatter: the input is P row blocks; each block is padded to whole groups and
  compressed as its own chunk, so chunk r is exactly the rows of rank r; then all-to-all,
  `sum_packed`, decode the own chunk.
- all_gather: compress, all-gather the buffers, decode all of them as one P-chunk buffer.

Group boundaries depend only on the position inside a piece, and pieces are cut at multiples
of P*G (all_reduce) or G (per block), so a piece boundary is always a group boundary. The
send, receive, sum and staging buffers come from a `Workspace` and are reused from call to call;
``out=None`` skips the decode (an emulated rank whose result another rank already decodes).
Every chunk a rank encodes carries the message's length tag, and every chunk it receives has
its header compared on arrival (`Message.check`); a sum keeps the codec's untagged header, since
it is decoded unchecked by every rank (made from compared chunks only).

Error feedback (``residual``, reduce_scatter and all_gather): the caller's fp32 tensor of x's
shape receives ``x - decode(what this rank sent)``, the part of x the wire did not carry,
computed from the send buffer itself while it travels; a reduce_scatter with a residual then
sums the received chunks decoded, in fp32, without requantising the sum (`sum_packed`'s second
rounding), so that its result is exactly the sum of what the ranks sent (to fp32 rounding) and
``result + residuals`` accounts for every input value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..codec import CodecConfig, WireLayout, api
from ..codec.api import decode_into, encode_into, sum_packed_into
from .pieces import piece_bounds, piece_length


class Message:
    """One compressed message, as its pieces share and report it: the tag of every chunk they encode
    (``tag``: `codec.layout.length_tag` of the whole message's length), where the headers of the
    chunks they receive are compared on the device (``header_flags``: the site's
    `codec.api.HeaderFlags`; None: not compared, an emulated group's virtual ranks), and back
    the bytes sent and (if asked) non-finite flags."""

    __slots__ = ("check_nonfinite", "sent", "nonfinite_flags", "tag", "header_flags")

    def __init__(self, check_nonfinite: bool = False, tag: int = 0, header_flags: api.HeaderFlags | None = None) -> None:
        self.check_nonfinite, self.sent, self.nonfinite_flags, self.tag = check_nonfinite, 0, [], tag
        self.header_flags = header_flags

    def check(self, buffer: torch.Tensor, layout: WireLayout, codec: CodecConfig, views: api.HeaderViews) -> None:
        """Compare the headers of the received ``buffer`` with this message's, on its device
        (`codec.api.compare_headers`: a chunk of another config or length reads as NaN and is
        flagged); ``views``: the buffer's cached `Workspace.header_views`."""
        if self.header_flags is not None:
            api.compare_headers(buffer, layout, codec, self.tag, self.header_flags, views)

    def note(self, layout: WireLayout, buffer: torch.Tensor) -> None:
        """Remember whether the scales of ``buffer`` hold a NaN (a non-finite group) when checking is on."""
        if self.check_nonfinite:
            self.nonfinite_flags.append(~torch.isfinite(layout.scales(buffer)).all())

class TwoShot(NamedTuple):
    """The views one piece of a two-shot collective works through (all-to-all, then each rank
    sums its chunk), made once per workspace slot and layout (a view costs host time)."""

    send: torch.Tensor  # [P * cb]: chunk p for rank p
    send_headers: torch.Tensor  # send's headers, what the message's tag is written through
    recv: torch.Tensor  # [P * cb]: chunk `rank` of every peer
    received: torch.Tensor  # recv as [P, cb]
    received_headers: api.HeaderViews  # received's, compared on arrival
    sum: torch.Tensor  # [cb]: this rank's chunk of the sum
    chunk: WireLayout  # one chunk's layout


class Workspace:
    """Buffers reused from call to call instead of fresh allocations: per piece a send buffer,
    a receive buffer (which the all-gather of the all-reduce then fills again: its chunks were
    summed by then), a sum buffer and, where a piece is not a contiguous run of whole groups, a
    staging buffer.

    One per group and device (the group's `dist_ops.Link` owns it), shared by the group's call sites: collectives of a model run one after another,
    and a call holds the workspace from its start to its result (`acquire`, then ``busy = False``; a
    second call in flight meanwhile, or a CUDA graph capture, gets a workspace of its own). A
    piece uses slot ``index % 3``: at most three pieces are in flight (`pieces`). Each buffer
    grows to the largest message seen and stays. Reuse is safe
    on NCCL: a collective's stream waits for the work queued before it, which includes the
    previous call's reads of the same buffer.
    """

    SLOTS = 3

    def __init__(self) -> None:
        self.busy = False
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # views handed out before, reused (a view costs host time)

    def buffer(self, role: str, slot: int, nbytes: int, device: torch.device, shape=None) -> torch.Tensor:
        """``nbytes`` uint8 of the buffer ``role`` in ``slot`` (grown if needed), viewed as
        ``shape`` if given."""
        key = (role, slot % self.SLOTS, nbytes, shape)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._grown(role, slot % self.SLOTS, nbytes, device)[:nbytes].view(shape or -1)
        return view

    def typed(self, role: str, slot: int, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` in the buffer ``role`` of ``slot``."""
        key = (role, slot % self.SLOTS, shape, dtype)
        view = self._views.get(key)
        if view is None:
            numel = math.prod(shape)
            raw = self._grown(role, slot % self.SLOTS, numel * dtype.itemsize, device)
            view = self._views[key] = raw[: numel * dtype.itemsize].view(dtype).view(shape)
        return view

    def header_views(self, role: str, slot: int, layout: WireLayout, buffer: torch.Tensor,
                     row: int = -1) -> api.HeaderViews:
        """The `codec.api.HeaderViews` of ``buffer`` (the buffer ``role`` of ``slot``, or its row
        ``row``), made once per layout: what `codec.api.compare_headers` checks a received chunk
        through, and (``.headers``) what a sent chunk's length tag is written through."""
        key = (role, slot % self.SLOTS, layout, row, "views")
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = api.header_views(buffer, layout)
        return found

    def two_shot(self, slot: int, layout: WireLayout, device: torch.device) -> TwoShot:
        """The `TwoShot` views of ``slot``'s buffers for ``layout`` (one chunk per rank), made once."""
        key = ("two_shot", slot % self.SLOTS, layout)
        found = self._views.get(key)
        if found is None:
            total, cb, chunk = layout.total_bytes, layout.chunk_bytes, layout.chunk_layout()
            send, received = self.buffer("send", slot, total, device), self.buffer("recv", slot, total, device)
            rows = received.view(layout.chunks, cb)
            found = self._views[key] = TwoShot(send, layout.headers(send), received, rows, api.header_views(rows, chunk),
                                               self.buffer("sum", slot, cb, device), chunk)
        return found

    def rows(self, role: str, slot: int, world: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """The ``world`` rows of ``nbytes`` each of the buffer ``role`` in ``slot``, as a list
        (what a gather writes into), made once per size."""
        key = (role, slot % self.SLOTS, world, nbytes, "rows")
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = list(self.buffer(role, slot, world * nbytes, device, (world, nbytes)).unbind(0))
        return found

    def _grown(self, role: str, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get((role, slot))
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[role, slot] = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device)
            self._views = {k: v for k, v in self._views.items() if k[1] != slot}  # the slot's views: of old buffers
        if len(self._views) > 256:  # many message sizes: start over rather than grow
            self._views.clear()
        return buf


def acquire(link, device: torch.device) -> Workspace:
    """The workspace of ``link``'s group on ``device`` (`dist_ops.Link.workspaces`: released
    with the group) if it is free (and no CUDA graph is being captured), else a workspace of
    this call's own (fresh buffers)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return Workspace()  # a captured graph must own its buffers (the graph's memory pool)
    workspaces = link.workspaces
    workspace = workspaces.get(device)
    if workspace is None:
        workspace = workspaces[device] = Workspace()
    if workspace.busy:
        return Workspace()
    workspace.busy = True
    return workspace


def all_reduce_piece(src: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                     buffers: Workspace, slot: int) -> Iterator:
    """out <- compressed two-shot sum over the ranks of src (same numel, both contiguous)."""
    world, device = link.world, src.device
    layout = WireLayout.for_tensor(src.numel(), codec, world)
    wire = buffers.two_shot(slot, layout, device)
    encode_into(src, wire.send, layout, codec, tag=message.tag, headers=wire.send_headers)
    work = link.all_to_all(wire.recv, wire.send)
    yield
    work.wait()
    _sum_received(wire, codec, message)
    full = wire.recv  # [P * cb]: every reduced chunk, rank order (the received chunks are summed by now)
    work = link.all_gather(full, wire.sum)
    yield
    work.wait()
    message.sent += 2 * (world - 1) * layout.chunk_bytes
    message.note(layout, full)
    if out is not None:  # every reduced chunk was checked where it was summed, from every rank's chunk
        decode_into(full, layout, codec, out, check=False)


def reduce_scatter_piece(blocks: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                         buffers: Workspace, slot: int, residual: torch.Tensor | None = None) -> Iterator:
    """out [c] <- this rank's row of the compressed sum over ranks of blocks [P, c] (or any
    contiguous tensor of P*c values, row r of which is rank r's). ``residual`` [P, c] (fp32, may
    be a strided view): blocks minus what was sent; the sum is then taken in fp32 (module doc)."""
    world, device = link.world, blocks.device
    cols = blocks.numel() // world
    width = -(-cols // codec.group_size) * codec.group_size
    if width != cols or not blocks.is_contiguous():  # each block padded with zeros to whole groups
        staged = buffers.typed("stage", slot, (world, width), blocks.dtype, device)
        staged[:, cols:].zero_()
        staged[:, :cols].copy_(blocks.reshape(world, cols))
        blocks = staged
    layout = WireLayout.for_tensor(world * width, codec, world)  # chunk r = block r
    wire = buffers.two_shot(slot, layout, device)
    recv = wire.recv
    encode_into(blocks, wire.send, layout, codec, tag=message.tag, headers=wire.send_headers)
    work = link.all_to_all(recv, wire.send)
    if residual is not None:  # while the chunks travel: what they do not carry of blocks
        decoded = buffers.typed("decoded", slot, (world, width), torch.float32, device)  # [P, width]
        decode_into(wire.send, layout, codec, decoded, check=False)  # this rank's own bytes
        residual.copy_(blocks.reshape(world, width)[:, :cols]).sub_(decoded[:, :cols])
    yield
    work.wait()
    message.sent += (world - 1) * layout.chunk_bytes
    if residual is not None:  # exactly the sum of what was sent: every chunk decoded (row p: peer p's), fp32 sum
        message.check(recv, layout, codec, buffers.header_views("recv", slot, layout, recv))
        decode_into(recv, layout, codec, decoded, check=False)
        message.note(layout, recv)
        if out is not None:
            out.copy_(decoded.sum(0)[:cols].view(out.shape))
        return
    mine = _sum_received(wire, codec, message)
    own = WireLayout.for_tensor(cols, codec)
    assert own.total_bytes == mine.numel(), (own, mine.numel())
    message.note(own, mine)
    if out is not None:
        decode_into(mine, own, codec, out, check=False)


def _sum_received(wire: TwoShot, codec: CodecConfig, message: Message) -> torch.Tensor:
    """``wire.sum`` <- the sum of the chunks every rank sent this rank, their headers compared first."""
    message.check(wire.received, wire.chunk, codec, wire.received_headers)
    sum_packed_into(wire.received, wire.chunk, codec, wire.sum, check=False)
    return wire.sum


def all_gather_piece(src: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                     buffers: Workspace, slot: int, residual: torch.Tensor | None = None) -> Iterator:
    """out [P, c] (may be a strided view, or any contiguous tensor of P*c values) <- every
    rank's src (c values, contiguous) decoded, in rank order. ``residual`` [c] (fp32): src
    minus what was sent of it."""
    world, device, cols = link.world, src.device, src.numel()
    layout = WireLayout.for_tensor(cols, codec)  # one chunk of gpc = ceil(c/G) groups
    send = buffers.buffer("send", slot, layout.total_bytes, device)
    headers = buffers.header_views("send", slot, layout, send).headers
    encode_into(src, send, layout, codec, tag=message.tag, headers=headers)
    full = buffers.buffer("recv", slot, world * layout.total_bytes, device)  # [P * cb]
    work = link.all_gather(full, send)
    if residual is not None:  # while the buffer travels: what it does not carry of src
        sent = buffers.typed("decoded", slot, (cols,), torch.float32, device)
        decode_into(send, layout, codec, sent, check=False)  # this rank's own bytes
        residual.copy_(src.view(-1)).sub_(sent)
    yield
    work.wait()
    width = layout.padded_numel  # gpc * G
    whole = WireLayout.for_tensor(world * width, codec, chunks=world)  # chunk p = rank p's buffer
    assert whole.total_bytes == full.numel(), (whole, full.numel())
    message.sent += (world - 1) * layout.total_bytes
    message.check(full, whole, codec, buffers.header_views("recv", slot, whole, full))
    message.note(whole, full)
    if out is not None:
        decode_rows(full, whole, codec, out, cols, buffers, slot)


def decode_rows(buffer: torch.Tensor, whole: WireLayout, codec: CodecConfig, out: torch.Tensor, cols: int,
                buffers: Workspace, slot: int, tag: int = 0, check: bool = False) -> None:
    """``out`` (a strided [P, cols] view, or any contiguous tensor of P * cols values) <- the P
    chunks of ``buffer`` (layout ``whole``, each chunk ``cols`` values padded to whole groups):
    straight into ``out`` where it is contiguous and no chunk is padded (no view made: a view
    costs host time), else through the staging buffer of ``slot``; ``tag``, ``check``: as
    `codec.api.decode_into`'s."""
    world = whole.chunks
    width = whole.padded_numel // world
    if width == cols and out.is_contiguous():
        decode_into(buffer, whole, codec, out, tag=tag, check=check)
        return
    decoded = buffers.typed("stage", slot, (world, width), out.dtype, buffer.device)
    decode_into(buffer, whole, codec, decoded, tag=tag, check=check)
    (out.view(world, cols) if out.is_contiguous() else out).copy_(decoded[:, :cols])


def all_gather_by_rank_piece(src: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                             buffers: Workspace) -> Iterator[int]:
    """out [P, c] (contiguous, or any contiguous tensor of P*c values) <- every rank's src (c
    values, contiguous) decoded, one rank's part at a time: yields each rank as its part lands
    in ``out`` (this rank's first, then the others in rank order). Each rank's wire is one
    broadcast from it: the same groups and bytes as `all_gather_piece` (``out=None``: nothing
    decoded, the rank still yielded)."""
    world, rank, device, cols = link.world, link.rank, src.device, src.numel()
    layout = WireLayout.for_tensor(cols, codec)  # one chunk of whole groups per rank
    cb = layout.total_bytes
    wires = buffers.buffer("recv", 0, world * cb, device, (world, cb))  # row r: rank r's wire
    encode_into(src, wires[rank], layout, codec, tag=message.tag,
                headers=buffers.header_views("recv", 0, layout, wires[rank], rank).headers)
    works = [link.broadcast(wires[r], r) for r in range(world)]
    parts = None if out is None else out.view(world, cols)
    for r in (rank, *range(rank), *range(rank + 1, world)):
        if r != rank:  # this rank's own broadcast is waited for last: its part is here already
            works[r].wait()
            message.check(wires[r], layout, codec, buffers.header_views("recv", 0, layout, wires[r], r))
        if parts is not None:  # this rank's part too: every rank decodes the same bytes
            decode_into(wires[r], layout, codec, parts[r], check=False)
        yield r
    works[rank].wait()
    message.sent += (world - 1) * cb
    message.note(WireLayout.for_tensor(world * layout.padded_numel, codec, chunks=world), wires.view(-1))


def reduce_scatter_by_rank_piece(parts: list, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                                 buffers: Workspace) -> Iterator[int]:
    """out [c] <- the compressed sum over ranks of their parts for this rank, one destination at
    a time: step r encodes ``parts[r]`` (c values, contiguous; the caller puts it there before
    the step) and gathers it to rank r, and yields r; then this rank sums what it received in
    rank order and decodes. The same groups and bytes as `reduce_scatter_piece`."""
    world, rank = link.world, link.rank
    cols = parts[0].numel()
    device = parts[0].device
    layout = WireLayout.for_tensor(cols, codec)
    cb = layout.total_bytes
    send = buffers.buffer("send", 0, world * cb, device, (world, cb))  # row r: this rank's part for rank r
    received = buffers.rows("recv", 0, world, cb, device)  # row p: rank p's part for this rank
    works = []
    for r in range(world):
        headers = buffers.header_views("send", 0, layout, send[r], r).headers
        encode_into(parts[r], send[r], layout, codec, tag=message.tag, headers=headers)
        parts[r] = None  # encoded: the caller's tensor is free
        works.append(link.gather(received if r == rank else None, send[r], r))
        yield r
    for work in works:
        work.wait()
    message.sent += (world - 1) * cb
    mine = buffers.buffer("sum", 0, cb, device)
    chunk = layout.chunk_layout()
    stacked = buffers.buffer("recv", 0, world * cb, device, (world, cb))  # row p: rank p's part for this rank
    message.check(stacked, chunk, codec, buffers.header_views("recv", 0, chunk, stacked))
    sum_packed_into(stacked, chunk, codec, mine, check=False)
    message.note(layout, mine)
    if out is not None:
        decode_into(mine, layout, codec, out, check=False)


# --- one call as pieces: views of the input and output, cut at group boundaries, each piece's
# generator in a list (`kinds.Kind.pieces`, what `pieces.Pipeline.of` runs) --------------------


def all_reduce_pieces(x: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                      buffers: Workspace, piece_bytes: int, residual: None = None):
    """The pieces of a compressed all_reduce of x into out (same shape, both contiguous); no
    error feedback (its second encoding, of the sum, belongs to no rank's input)."""
    assert residual is None, "the two-shot all_reduce has no residual: reduce_scatter, then all_gather"
    step = piece_length(piece_bytes, x.element_size(), link.world * codec.group_size)
    bounds = piece_bounds(x.numel(), step)
    if len(bounds) == 1:  # one piece: the tensors as they are (each view costs host time)
        return [all_reduce_piece(x, out, codec, link, message, buffers, 0)]
    src, dst = x.view(-1), None if out is None else out.view(-1)  # [n]
    return [all_reduce_piece(src[a:b], None if dst is None else dst[a:b], codec, link, message, buffers, slot)
            for slot, (a, b) in enumerate(bounds)]


def reduce_scatter_pieces(x: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                          buffers: Workspace, piece_bytes: int, residual: torch.Tensor | None = None):
    """The pieces of a compressed reduce_scatter of x [P*m, ...] into out [m, ...] (contiguous);
    ``residual``: fp32, contiguous, x's number of values."""
    world = link.world
    step = piece_length(piece_bytes, world * x.element_size(), codec.group_size)
    bounds = piece_bounds(x.numel() // world, step)
    lost = None if residual is None else residual.view(world, -1)  # [P, k]
    if len(bounds) == 1:
        return [reduce_scatter_piece(x, out, codec, link, message, buffers, 0, lost)]
    blocks = x.view(world, -1)  # [P, k] (row r: the rows of rank r)
    dst = None if out is None else out.view(-1)  # [k]
    return [reduce_scatter_piece(blocks[:, a:b], None if dst is None else dst[a:b], codec, link, message, buffers,
                                 slot, None if lost is None else lost[:, a:b]) for slot, (a, b) in enumerate(bounds)]


def all_gather_pieces(x: torch.Tensor, out: torch.Tensor | None, codec: CodecConfig, link, message: Message,
                      buffers: Workspace, piece_bytes: int, residual: torch.Tensor | None = None):
    """The pieces of a compressed all_gather of x [m, ...] into out [P*m, ...] (contiguous);
    ``residual``: fp32, contiguous, x's number of values."""
    step = piece_length(piece_bytes, x.element_size(), codec.group_size)
    bounds = piece_bounds(x.numel(), step)
    lost = None if residual is None else residual.view(-1)  # [k]
    if len(bounds) == 1:
        return [all_gather_piece(x, out, codec, link, message, buffers, 0, lost)]
    src = x.view(-1)  # [k]
    blocks = None if out is None else out.view(link.world, -1)  # [P, k] (row p: rank p's x)
    return [all_gather_piece(src[a:b], None if blocks is None else blocks[:, a:b], codec, link, message, buffers,
                             slot, None if lost is None else lost[a:b]) for slot, (a, b) in enumerate(bounds)]


def per_rank_pieces(piece):
    """The pieces of a per-rank kind whose one piece is ``piece``: the whole message (a rank's part,
    not a piece, is the unit that overlaps compute); no residual (`kinds.Kind.no_residual`)."""
    def pieces(x, out: torch.Tensor | None, codec: CodecConfig, link, message: Message, buffers: Workspace,
               piece_bytes: int = 0, residual: None = None):
        return [piece(x, out, codec, link, message, buffers)]
    return pieces
