"""Compressed collectives over torch.distributed process groups: the public entry points.

Each function takes an explicit ``group`` (None: the default group, i.e. the world) and works
on any group: the world, or a sub-group such as the TP group of a dp x tp mesh. With
``config=None``, a group of one rank, an empty tensor, or a message (the input tensor) under
``config.threshold_bytes``, it runs the plain collective in the input dtype; otherwise the
TACO compressed path (`compressed`), in pieces of about ``config.piece_bytes`` whose codec
work overlaps the transfer of their neighbours (`pipeline`). Either way the result is a new
tensor of the input's dtype, and every rank of the group must make the same call.

Autograd: the inputs are detached and the results do not require grad; layer 3 wraps these
functions in autograd functions that define the backward collectives.

Non-finite values follow ``config.nonfinite`` on both paths. ``"propagate"``: a group holding
NaN or Inf decodes to NaN on every rank (the plain path keeps them as they are). ``"zero"``:
they count as 0. ``"raise"``: every rank of the group raises `NonFiniteError` when any rank's
input (or the fp32 sum) is non-finite. The decision is taken after the transfer, on bytes
every rank holds identically (the all_reduce / all_gather result) or on a flag all ranks
agree on through one tiny all-reduce (reduce_scatter, plain paths), so that a rank-local NaN
never leaves the others blocked in a collective. It costs one host sync per call.

Statistics (bytes sent, sampled error) are recorded per ``site`` name; see `stats`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..codec import NonFiniteError, TacoConfig
from . import stats
from .compressed import Tally, all_gather_pieces, all_reduce_pieces, reduce_scatter_pieces
from .dist_ops import all_gather_into, all_reduce_, reduce_scatter_into
from .pipeline import run_pipelined

_PIECES = dict(all_reduce=all_reduce_pieces, reduce_scatter=reduce_scatter_pieces, all_gather=all_gather_pieces)
_SAME_BYTES_EVERYWHERE = {"all_reduce": True, "reduce_scatter": False, "all_gather": True}


def all_reduce(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None
) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group``: a new tensor of x's shape and dtype.

    Compressed: the two-shot TACO all-reduce; every rank gets bit-identical bytes.
    """
    return _collective("all_reduce", x, x.shape, group, config, site)


def reduce_scatter(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None
) -> torch.Tensor:
    """x has P*m rows along dim 0; returns this rank's m rows of the sum over the group's ranks.

    Compressed: each rank's row block is compressed as its own chunk (padded to whole
    groups), exchanged all-to-all, summed with `sum_packed` and decoded by its rank.
    """
    world = _world(group)
    _check_rows(x, world)
    return _collective("reduce_scatter", x, (x.shape[0] // world, *x.shape[1:]), group, config, site)


def all_gather(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None
) -> torch.Tensor:
    """Concatenation of every rank's ``x`` along dim 0, in rank order.

    Compressed: compress, all-gather the buffers, decode all; every rank gets the same bytes.
    """
    _check_rows(x)
    return _collective("all_gather", x, (x.shape[0] * _world(group), *x.shape[1:]), group, config, site)


# --- shared steps -----------------------------------------------------------------------------


def _check_rows(x: torch.Tensor, world: int | None = None) -> None:
    """reduce_scatter (``world`` given) needs dim 0 divisible by it; all_gather a dim 0."""
    if world is None and x.dim() == 0:
        raise ValueError("all_gather needs x with at least one dimension (got a 0-d tensor); use x.view(1)")
    if world is not None and (x.dim() == 0 or x.shape[0] % world):
        raise ValueError(
            f"reduce_scatter needs dim 0 of x (shape {list(x.shape)}) divisible by the group "
            f"size {world}; pad or trim dim 0 to a multiple of {world}"
        )


def _world(group) -> int:
    world = dist.get_world_size(group)
    if world < 1:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the group; call collectives on its members only"
        )
    return world


def _collective(kind: str, x: torch.Tensor, out_shape, group, config: TacoConfig | None, site: str | None):
    """Run ``kind`` plain or compressed into a new tensor of ``out_shape``; record its stats."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kind} expects a torch.Tensor, got {type(x).__name__}")
    x, world, site = x.detach(), _world(group), site or kind
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    nbytes = x.numel() * x.element_size()
    plain = stats.plain_bytes(kind, nbytes, world)
    if _plain_path(config, nbytes, world):
        _plain(kind, _zero_policy(x, config).contiguous(), out, group, world)
        stats.record(site, sent=plain, uncompressed=plain, compressed=False)
        if config is not None and config.nonfinite == "raise" and out.is_floating_point():
            _raise_if_flag(~torch.isfinite(out).all(), group, world, site, agree=not _SAME_BYTES_EVERYWHERE[kind])
        return out
    tally = Tally(check_nonfinite=config.nonfinite == "raise")
    run_pipelined(_PIECES[kind](x.contiguous(), out, _codec_config(config), group, world, tally))
    stats.record(site, sent=tally.sent, uncompressed=plain, compressed=True)
    if stats.should_sample(site):
        stats.record_error(site, _relative_error(out, _exact(kind, x, out_shape, group)))
    if tally.check_nonfinite:
        _raise_if_flag(tally.any_nonfinite(), group, world, site, agree=not _SAME_BYTES_EVERYWHERE[kind])
    return out


def _plain_path(config: TacoConfig | None, nbytes: int, world: int) -> bool:
    """Whether a message of ``nbytes`` (input bytes) goes through the plain collective."""
    return config is None or world == 1 or nbytes == 0 or nbytes < config.threshold_bytes


def _plain(kind: str, src: torch.Tensor, out: torch.Tensor, group, world: int) -> None:
    """out <- the plain collective ``kind`` of src (contiguous), in src's dtype."""
    if world == 1:
        out.copy_(src.view(out.shape))
    elif kind == "all_reduce":
        out.copy_(src)
        all_reduce_(out, group)
    elif kind == "reduce_scatter":
        reduce_scatter_into(out, src, group)
    else:
        all_gather_into(out, src, group).wait()


@functools.lru_cache(maxsize=64)
def _codec_config(config: TacoConfig) -> TacoConfig:
    """The codec's config: under "raise" the codec propagates and we raise after the transfer."""
    return config.replace(nonfinite="propagate") if config.nonfinite == "raise" else config


def _zero_policy(x: torch.Tensor, config: TacoConfig | None) -> torch.Tensor:
    if config is not None and config.nonfinite == "zero" and x.is_floating_point():
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return x


def _raise_if_flag(flag: torch.Tensor, group, world: int, site: str, *, agree: bool) -> None:
    """Raise NonFiniteError on every rank if ``flag`` (0-d bool) is set on any rank of ``group``.

    ``agree=False`` when the flag is known to be identical on every rank (every rank holds the
    same bytes: all-reduce and all-gather, plain or compressed): no exchange.
    """
    if agree and world > 1:
        flag = flag.to(torch.int32).view(1)
        all_reduce_(flag, group, op=dist.ReduceOp.MAX)
    if bool(flag.any()):  # the host sync that "raise" costs
        raise _nonfinite_error(site)


def _nonfinite_error(site: str) -> NonFiniteError:
    return NonFiniteError(
        f"{site}: a rank's input (or the sum) holds NaN or Inf under TacoConfig.nonfinite='raise'; "
        "find where the run diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
    )


def _exact(kind: str, x: torch.Tensor, out_shape, group) -> torch.Tensor:
    """The float64 result of the plain collective (one extra collective, for error sampling)."""
    ref = torch.empty(out_shape, dtype=torch.float64, device=x.device)
    _plain(kind, x.double().contiguous(), ref, group, dist.get_world_size(group))
    return ref


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``||out - exact|| / ||exact||`` as a 0-d tensor (``||out - exact||`` when exact is 0)."""
    err, norm = (out.double() - exact).norm(), exact.norm()
    return torch.where(norm > 0, err / norm, err)
