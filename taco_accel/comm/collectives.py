"""Compressed collectives over torch.distributed process groups: the public entry points (each
call a `call.Call`, the one call path that they, the `site.Site` of layer 3, `autotune` and the
emulated groups share).

Each function takes an explicit ``group`` (None: the default group, i.e. the world) and works
on any group: the world, or a sub-group such as the TP group of a dp x tp mesh. They are the
codec-level escape hatch, with no policy of their own (`policy.Compression`'s modes, floor and
piece size apply through a `site.Site`): with a ``config`` (`TacoConfig`) a message is
compressed unless ``compress=False``; ``config=None``, a group of one rank, an empty tensor or a
dtype the codec does not encode (integers, bool, float64: they go exact) is always plain
(``compress=True`` on such a dtype raises). Plain is the collective in the input dtype;
compressed is the TACO path (`compressed`), in pieces of about ``piece_bytes`` (default
`pieces.PIECE_BYTES`; 0: whole) whose codec work overlaps the transfer of their neighbours
(`pieces`). Every rank of the group must make the same call.

The result is a new tensor of the input's dtype, or with ``inplace=True`` (all_reduce) the
input itself, which the caller gives away: the plain sum is reduced in it (Megatron's reduction,
no copy) and the compressed one decoded into it. Autograd: the inputs are detached and the
results do not require grad; layer 3 wraps these functions in autograd functions that define
the backward collectives.

Error feedback (reduce_scatter, all_gather): ``residual=`` a float32 tensor of x's number of
values receives what the wire did not carry of x (``x - decode(what this rank sent)``; zeros
when the call is plain), and a compressed reduce_scatter then sums the received chunks decoded,
in fp32, instead of requantising the sum: its result is the sum of what the ranks sent, so that
result plus every rank's residual is the sum of the inputs (to fp32 rounding). A caller adds the
residual to its next input (`taco_accel.parallel.data_parallel`'s compressed gradient reduce).

``async_op=True`` returns the `call.Call` instead: the transfer (plain), or the first piece
(compressed), is under way; call ``progress()`` between other work so that compressed pieces
advance, and ``wait()`` for the result. Layer 3 overlaps the backward all-reduce of a
column-parallel region's input gradient with the weight-gradient matmuls this way (Megatron).

Non-finite values follow ``config.nonfinite`` on both paths. ``"propagate"``: a group holding
NaN or Inf decodes to NaN on every rank (the plain path keeps them as they are; nothing looks at
the data). ``"zero"``: they count as 0. ``"raise"``: every rank of the group raises
`NonFiniteError` when any rank's input (or the fp32 sum) is non-finite, at one host sync per call
(`call.Call`: how every rank takes the same decision).

Statistics (bytes sent, sampled error) are recorded under the ``site`` name in the process's
``stats.DEFAULT`` ledger (a `site.Site` records in its own table's). Each site's first call
(every call with ``TACO_CHECK_COLLECTIVES=1``) first checks that every rank makes the same call
(`agreement`: a `CollectiveMismatch` on every rank otherwise), and a transfer that outlives the
group's timeout raises a `CollectiveTimeout` naming the site. Ranks whose later calls differ in
length: see `codec.api` and `agreement` (every compressed chunk carries a tag of the message's
length).
"""

from __future__ import annotations

import torch

from ..codec import CodecConfig
from ..codec.api import SUPPORTED_DTYPES, check_config
from . import dist_ops
from .call import Call
from .kinds import Kind, kind_of
from .pieces import PIECE_BYTES
from .stats import DEFAULT


def all_reduce(
    x: torch.Tensor, group=None, config: CodecConfig | None = None, *, site: str | None = None,
    async_op: bool = False, compress: bool | None = None, inplace: bool = False, piece_bytes: int = PIECE_BYTES,
):
    """Sum of ``x`` over the ranks of ``group``, of x's shape and dtype (``x`` itself with
    ``inplace=True``).

    Compressed: the two-shot TACO all-reduce; every rank gets bit-identical bytes.
    """
    return _public("all_reduce", x, group, config, site, async_op, compress, inplace, None, piece_bytes)


def reduce_scatter(
    x: torch.Tensor, group=None, config: CodecConfig | None = None, *, site: str | None = None,
    async_op: bool = False, compress: bool | None = None, residual: torch.Tensor | None = None,
    piece_bytes: int = PIECE_BYTES,
):
    """x has P*m rows along dim 0; returns this rank's m rows of the sum over the group's ranks.

    Compressed: each rank's row block is compressed as its own chunk (padded to whole
    groups), exchanged all-to-all, summed with `sum_packed` and decoded by its rank (with a
    ``residual``: decoded, then summed in fp32; see the module doc).
    """
    return _public("reduce_scatter", x, group, config, site, async_op, compress, False, residual, piece_bytes)


def all_gather(
    x: torch.Tensor, group=None, config: CodecConfig | None = None, *, site: str | None = None,
    async_op: bool = False, compress: bool | None = None, residual: torch.Tensor | None = None,
    piece_bytes: int = PIECE_BYTES,
):
    """Concatenation of every rank's ``x`` along dim 0, in rank order.

    Compressed: compress, all-gather the buffers, decode all; every rank gets the same bytes.
    """
    return _public("all_gather", x, group, config, site, async_op, compress, False, residual, piece_bytes)


def _public(name: str, x, group, config, site, async_op: bool, compress, inplace: bool, residual=None,
            piece_bytes: int = PIECE_BYTES):
    """The argument checks of the public functions; then the `call.Call`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if config is not None:
        config = check_config(config, name)
    if compress is None:
        compress = True  # whenever a config is given and `call.compresses` allows it
    elif not isinstance(compress, bool):
        raise TypeError(f"{name}(compress={compress!r}): pass True, False or None (compressed when a config is given)")
    elif compress and config is None:
        raise ValueError(f"{name}(compress=True) needs the codec settings: pass config=TacoConfig(...)")
    elif compress and x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}(compress=True) of a {x.dtype} tensor: the codec encodes only {SUPPORTED_DTYPES} "
                        "(anything else would arrive inexact); leave compress=None, which sends it plain, or cast it")
    x = x.detach()
    link = dist_ops.link(group)
    kind = kind_of(name)
    kind.check(x, link.world)
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 0:
        raise ValueError(f"{name}(piece_bytes={piece_bytes!r}) must be an int >= 0 (bytes; 0: one piece)")
    site = site or name
    call = Call(kind, x, link, config, compress, piece_bytes, DEFAULT.record(site), site)
    call.start(x, inplace, check_residual(kind, x, residual))
    return call if async_op else call.wait()


def check_residual(kind: Kind, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """``residual`` if it can take x's error feedback (reduce_scatter or all_gather; float32,
    contiguous, x's number of values, on x's device); a TypeError or ValueError naming the fix."""
    if residual is None:
        return None
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{kind.name}(residual={type(residual).__name__}): pass a float32 tensor of x's size, or None")
    if kind.no_residual is not None:
        raise ValueError(kind.no_residual)
    if residual.dtype != torch.float32 or residual.numel() != x.numel() or not residual.is_contiguous() \
            or residual.device != x.device:
        raise ValueError(f"{kind.name}: residual must be a contiguous float32 tensor of {x.numel()} values on "
                         f"{x.device} (x's size), got {residual.dtype} {list(residual.shape)} on {residual.device}")
    return residual
