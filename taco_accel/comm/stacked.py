"""The compressed collectives of P virtual ranks whose tensors are stacked in one tensor [P, ...]:
each codec step runs once for all ranks instead of once per rank.

What a real group of P ranks computes, bit for bit (`compressed`, one piece; the codec works
group by group, and every chunk is whole groups, so one call over the ranks' buffers laid end
to end writes the bytes of the P calls, `codec.api.encode_rows_into`):

- all_reduce: every rank's P-chunk buffer encoded in one call ([P ranks x P chunks]). Rank r's
  two-shot sum is `sum_packed` of chunk r of every rank; one `sum_packed` of the P buffers
  under the P-chunk layout is every rank's sum at once, chunk r being rank r's: it is the
  all-gathered buffer every rank decodes. No all-to-all or all-gather is needed: the bytes are
  already where the sum reads them.
- reduce_scatter: every rank's P blocks encoded as P x P one-chunk rows; one `sum_packed` over
  the ranks is every rank's reduced chunk, decoded in one call.
- all_gather: every rank's buffer encoded in one call is the gathered buffer; decoded once.

Each returns (output, bytes one rank sends); `run` picks the one of a `kinds.Kind` (the per-rank
kinds send the same bytes as their whole counterparts). Error feedback (``residual``) and
messages of several pieces run the per-rank path of `emulated`.
"""

from __future__ import annotations

import torch

from ..codec import CodecConfig, WireLayout
from ..codec.api import decode_into, encode_rows_into, sum_packed_into
from .compressed import Workspace, decode_rows


def run(kind, xs: torch.Tensor, codec: CodecConfig, tag: int, buffers: Workspace) -> tuple[torch.Tensor, int]:
    """The stacked road of the collective ``kind`` (a `kinds.Kind`) for the P stacked tensors ``xs``."""
    if not kind.reduces:
        return all_gather(xs, codec, tag, buffers)
    return (reduce_scatter if kind.scatters else all_reduce)(xs, codec, tag, buffers)


def all_reduce(xs: torch.Tensor, codec: CodecConfig, tag: int, buffers: Workspace) -> tuple[torch.Tensor, int]:
    """The sum of the P stacked tensors ``xs`` [P, ...] through the two-shot all-reduce."""
    world, device = xs.shape[0], xs.device
    layout = WireLayout.for_tensor(xs[0].numel(), codec, world)  # one rank's message: P chunks
    send = buffers.buffer("send", 0, world * layout.total_bytes, device)  # [rank p][chunk r]
    encode_rows_into(xs.view(world, -1), send, layout, codec, tag=tag, stage=_stage(buffers, world, layout, xs))
    full = buffers.buffer("sum", 0, layout.total_bytes, device)  # chunk r: rank r's reduced chunk
    sum_packed_into(send.view(world, layout.total_bytes), layout, codec, full, tag=tag)
    out = torch.empty_like(xs[0])
    decode_into(full, layout, codec, out, tag=tag)
    return out, 2 * (world - 1) * layout.chunk_bytes


def reduce_scatter(xs: torch.Tensor, codec: CodecConfig, tag: int, buffers: Workspace) -> tuple[torch.Tensor, int]:
    """Every rank's rows of the sum of ``xs`` [P, P*m, ...], stacked in rank order ([P*m, ...])."""
    world, device = xs.shape[0], xs.device
    cols = xs[0].numel() // world
    block = WireLayout.for_tensor(cols, codec)  # block r of a rank: chunk r of its message
    chunk = block.total_bytes
    send = buffers.buffer("send", 0, world * world * chunk, device)  # [rank p][block r]
    encode_rows_into(xs.view(world * world, cols), send, block, codec, tag=tag,
                     stage=_stage(buffers, world * world, block, xs))
    mine = WireLayout.for_tensor(world * block.padded_numel, codec, world)  # chunk r: rank r's rows
    full = buffers.buffer("sum", 0, mine.total_bytes, device)
    sum_packed_into(send.view(world, world * chunk), mine, codec, full, tag=tag)
    out = torch.empty_like(xs[0])
    decode_rows(full, mine, codec, out, cols, buffers, 0, tag, check=True)
    return out, (world - 1) * chunk


def all_gather(xs: torch.Tensor, codec: CodecConfig, tag: int, buffers: Workspace) -> tuple[torch.Tensor, int]:
    """Every rank's tensor of ``xs`` [P, m, ...] decoded, concatenated along dim 0 ([P*m, ...])."""
    world, device = xs.shape[0], xs.device
    cols = xs[0].numel()
    layout = WireLayout.for_tensor(cols, codec)  # one rank's buffer
    full = buffers.buffer("send", 0, world * layout.total_bytes, device)  # what every rank gathers
    whole = encode_rows_into(xs.view(world, cols), full, layout, codec, tag=tag, stage=_stage(buffers, world, layout, xs))
    out = xs.new_empty((world * xs.shape[1], *xs.shape[2:]))
    decode_rows(full, whole, codec, out, cols, buffers, 0, tag, check=True)
    return out, (world - 1) * layout.total_bytes


def _stage(buffers: Workspace, rows: int, layout: WireLayout, xs: torch.Tensor) -> torch.Tensor | None:
    """Where rows of ``layout.numel`` values are padded to whole chunks (None: they need not be)."""
    if layout.padded_numel == layout.numel:
        return None
    return buffers.typed("stage", 0, (rows, layout.padded_numel), xs.dtype, xs.device)

