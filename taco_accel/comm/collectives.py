"""Compressed collectives over torch.distributed process groups: the public entry points.

Each function takes an explicit ``group`` (None: the default group, i.e. the world) and works
on any group: the world, or a sub-group such as the TP group of a dp x tp mesh. With
``config=None``, a group of one rank, an empty tensor, or a message (the input tensor) under
``config.threshold_bytes``, it runs the plain collective in the input dtype; otherwise the
TACO compressed path (`compressed`), in pieces of about ``config.piece_bytes`` whose codec
work overlaps the transfer of their neighbours (`pieces`). Either way the result is a new
tensor of the input's dtype, and every rank of the group must make the same call.

Autograd: the inputs are detached and the results do not require grad; layer 3 wraps these
functions in autograd functions that define the backward collectives.

``async_op=True`` returns a `Pending` instead: the transfer (plain), or the first piece
(compressed), is under way; call ``progress()`` between other work so that compressed pieces
advance, and ``wait()`` for the result. Layer 3 overlaps the backward all-reduce of a
column-parallel region's input gradient with the weight-gradient matmuls this way (Megatron).

Non-finite values follow ``config.nonfinite`` on both paths. ``"propagate"``: a group holding
NaN or Inf decodes to NaN on every rank (the plain path keeps them as they are). ``"zero"``:
they count as 0. ``"raise"``: every rank of the group raises `NonFiniteError` when any rank's
input (or the fp32 sum) is non-finite. The decision is taken after the transfer, on bytes
every rank holds identically (the all_reduce / all_gather result) or on a flag all ranks
agree on through one tiny all-reduce (reduce_scatter, plain paths), so that a rank-local NaN
never leaves the others blocked in a collective. It costs one host sync per call.

Statistics (bytes sent, sampled error) are recorded per ``site`` name; see `stats`. Each
site's first call (every call with ``TACO_CHECK_COLLECTIVES=1``) first checks that every rank
makes the same call (`agreement`: a `CollectiveMismatch` on every rank otherwise), and a
transfer that outlives the group's timeout raises a `CollectiveTimeout` naming the site.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..codec import NonFiniteError, TacoConfig
from . import agreement, stats
from .compressed import Tally, acquire, all_gather_pieces, all_reduce_pieces, reduce_scatter_pieces, release
from .dist_ops import Done, all_gather_into, all_reduce_, reduce_scatter_into
from .pieces import Pipeline

_PIECES = dict(all_reduce=all_reduce_pieces, reduce_scatter=reduce_scatter_pieces, all_gather=all_gather_pieces)
_SAME_BYTES_EVERYWHERE = {"all_reduce": True, "reduce_scatter": False, "all_gather": True}


def all_reduce(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None,
    async_op: bool = False,
):
    """Sum of ``x`` over the ranks of ``group``: a new tensor of x's shape and dtype.

    Compressed: the two-shot TACO all-reduce; every rank gets bit-identical bytes.
    """
    return _collective("all_reduce", x, group, config, site, async_op)


def reduce_scatter(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None,
    async_op: bool = False,
):
    """x has P*m rows along dim 0; returns this rank's m rows of the sum over the group's ranks.

    Compressed: each rank's row block is compressed as its own chunk (padded to whole
    groups), exchanged all-to-all, summed with `sum_packed` and decoded by its rank.
    """
    return _collective("reduce_scatter", x, group, config, site, async_op)


def all_gather(
    x: torch.Tensor, group=None, config: TacoConfig | None = None, *, site: str | None = None,
    async_op: bool = False,
):
    """Concatenation of every rank's ``x`` along dim 0, in rank order.

    Compressed: compress, all-gather the buffers, decode all; every rank gets the same bytes.
    """
    return _collective("all_gather", x, group, config, site, async_op)


# --- shared steps -----------------------------------------------------------------------------


def output_shape(kind: str, x: torch.Tensor, world: int) -> tuple[int, ...]:
    """Shape of the result of ``kind`` on this rank's ``x`` over ``world`` ranks."""
    if kind == "reduce_scatter":
        return (x.shape[0] // world, *x.shape[1:])
    if kind == "all_gather":
        return (x.shape[0] * world, *x.shape[1:])
    return tuple(x.shape)


def check_rows(x: torch.Tensor, world: int | None = None) -> None:
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


def _collective(kind: str, x: torch.Tensor, group, config: TacoConfig | None, site: str | None,
                async_op: bool = False):
    """Run ``kind`` plain or compressed into a new tensor; record its stats (at `Pending.wait`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kind} expects a torch.Tensor, got {type(x).__name__}")
    x, world = x.detach(), _world(group)
    if kind != "all_reduce":
        check_rows(x, world if kind == "reduce_scatter" else None)
    pending = Pending(kind, x, group, config, site or kind, world)
    return pending if async_op else pending.wait()


class Pending:
    """A collective in flight: `progress` lets compressed pieces advance between other work,
    `wait` returns the result (and records the site's statistics).

    The plain collective is one ``async_op`` call of torch.distributed; the compressed one is
    a `Pipeline` of pieces, each `progress` one tick of it (codec work of one piece, the
    transfers of the others in flight). Every rank of the group must call `progress` as
    often, in the same order relative to other collectives.
    """

    def __init__(self, kind: str, x: torch.Tensor, group, config: TacoConfig | None, site: str,
                 world: int | None = None) -> None:
        self.kind, self.x, self.group, self.config, self.site = kind, x, group, config, site
        self.world = _world(group) if world is None else world
        self.out = torch.empty(output_shape(kind, x, self.world), dtype=x.dtype, device=x.device)
        nbytes = x.numel() * x.element_size()
        self.compressed = not plain_path(config, nbytes, self.world)
        if agreement.due(site):  # the same calls on every rank: checked before any byte moves
            agreement.check(kind, x, group, config, self.compressed, site, self.world)
        if self.compressed:
            self.tally = Tally(check_nonfinite=config.nonfinite == "raise")
            self._buffers = acquire(x.device)  # receive buffers reused from call to call
            pieces = _PIECES[kind](x.contiguous(), self.out, codec_config(config), group, self.world, self.tally,
                                   self._buffers)
            self._pipeline = Pipeline.of(list(pieces))
            with agreement.named_timeouts(site, kind, group):
                self._pipeline.tick()  # the first piece encoded and on the wire
        else:
            self.sent = stats.plain_bytes(kind, nbytes, self.world)
            self._work = _plain(kind, zero_policy(x, config).contiguous(), self.out, group, self.world)
        self._done = False

    def progress(self) -> None:
        """One step of the compressed pipeline (nothing for a plain collective)."""
        if self.compressed and not self._done:
            with agreement.named_timeouts(self.site, self.kind, self.group):
                self._done = not self._pipeline.tick()

    def result(self) -> tuple[torch.Tensor, int, bool]:
        """``(out, bytes this rank sent, compressed?)`` once complete; no statistics."""
        if self.compressed:
            try:
                with agreement.named_timeouts(self.site, self.kind, self.group):
                    self._pipeline.finish()
            finally:
                release(self._buffers)
            self.sent = self.tally.sent
            flag = self.tally.any_nonfinite() if self.tally.check_nonfinite else None
        else:
            with agreement.named_timeouts(self.site, self.kind, self.group):
                self._work.wait()
            raising = self.config is not None and self.config.nonfinite == "raise" and self.out.is_floating_point()
            flag = ~torch.isfinite(self.out).all() if raising else None
        if flag is not None:
            raise_if_flag(flag, self.group, self.world, self.site, agree=not _SAME_BYTES_EVERYWHERE[self.kind])
        return self.out, self.sent, self.compressed

    def wait(self) -> torch.Tensor:
        """The result, a new tensor; records the call under its site."""
        out, sent, compressed = self.result()
        nbytes = self.x.numel() * self.x.element_size()
        stats.record(self.site, sent=sent, uncompressed=stats.plain_bytes(self.kind, nbytes, self.world),
                     compressed=compressed)
        if compressed and stats.should_sample(self.site):
            stats.record_error(self.site, relative_error(out, _exact(self.kind, self.x, out.shape, self.group)))
        return out


def run_collective(kind: str, x: torch.Tensor, group, config: TacoConfig | None, site: str = ""):
    """``(out, bytes this rank sent, compressed?)`` of ``kind`` on the detached ``x``; no
    statistics (`autotune` times with it)."""
    return Pending(kind, x, group, config, site).result()


def plain_path(config: TacoConfig | None, nbytes: int, world: int) -> bool:
    """Whether a message of ``nbytes`` (input bytes) goes through the plain collective."""
    return config is None or world == 1 or nbytes == 0 or nbytes < config.threshold_bytes


def _plain(kind: str, src: torch.Tensor, out: torch.Tensor, group, world: int):
    """Start out <- the plain collective ``kind`` of src (contiguous), in src's dtype; returns
    its work handle."""
    if world == 1:
        out.copy_(src.view(out.shape))
        return Done()
    if kind == "all_reduce":
        out.copy_(src)
        return all_reduce_(out, group, async_op=True)
    if kind == "reduce_scatter":
        return reduce_scatter_into(out, src, group, async_op=True)
    return all_gather_into(out, src, group)


@functools.lru_cache(maxsize=64)
def codec_config(config: TacoConfig) -> TacoConfig:
    """The codec's config: under "raise" the codec propagates and we raise after the transfer."""
    return config.replace(nonfinite="propagate") if config.nonfinite == "raise" else config


def zero_policy(x: torch.Tensor, config: TacoConfig | None) -> torch.Tensor:
    if config is not None and config.nonfinite == "zero" and x.is_floating_point():
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return x


def raise_if_flag(flag: torch.Tensor, group, world: int, site: str, *, agree: bool) -> None:
    """Raise NonFiniteError on every rank if ``flag`` (0-d bool) is set on any rank of ``group``.

    ``agree=False`` when the flag is known to be identical on every rank (every rank holds the
    same bytes: all-reduce and all-gather, plain or compressed): no exchange.
    """
    if agree and world > 1:
        flag = flag.to(torch.int32).view(1)
        all_reduce_(flag, group, op=dist.ReduceOp.MAX)
    if bool(flag.any()):  # the host sync that "raise" costs
        raise nonfinite_error(site)


def nonfinite_error(site: str) -> NonFiniteError:
    return NonFiniteError(
        f"{site}: a rank's input (or the sum) holds NaN or Inf, or a group of finite values too large "
        "for the codec's fp32 sums (max |x| past about 3.4e38 / G), under TacoConfig.nonfinite='raise'; "
        "find where the run diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
    )


def _exact(kind: str, x: torch.Tensor, out_shape, group) -> torch.Tensor:
    """The float64 result of the plain collective (one extra collective, for error sampling)."""
    ref = torch.empty(out_shape, dtype=torch.float64, device=x.device)
    _plain(kind, x.double().contiguous(), ref, group, dist.get_world_size(group)).wait()
    return ref


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``||out - exact|| / ||exact||`` as a 0-d tensor (``||out - exact||`` when exact is 0)."""
    err, norm = (out.double() - exact).norm(), exact.norm()
    return torch.where(norm > 0, err / norm, err)
