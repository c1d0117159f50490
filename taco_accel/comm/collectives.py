"""Compressed collectives over torch.distributed process groups: the public entry points and
`Pending`, the one call path that they, the `site.Site` of layer 3 and `autotune` share.

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

``async_op=True`` returns the `Pending` instead: the transfer (plain), or the first piece
(compressed), is under way; call ``progress()`` between other work so that compressed pieces
advance, and ``wait()`` for the result. Layer 3 overlaps the backward all-reduce of a
column-parallel region's input gradient with the weight-gradient matmuls this way (Megatron).

Non-finite values follow ``config.nonfinite`` on both paths. ``"propagate"``: a group holding
NaN or Inf decodes to NaN on every rank (the plain path keeps them as they are; nothing looks at
the data). ``"zero"``: they count as 0. ``"raise"``: every rank of the group raises
`NonFiniteError` when any rank's input (or the fp32 sum) is non-finite. The decision is taken
after the transfer, on bytes every rank holds identically (the all_reduce / all_gather result)
or on a flag all ranks agree on through one tiny all-reduce (reduce_scatter), so that a
rank-local NaN never leaves the others blocked in a collective. It costs one host sync per call.

Ranks whose calls differ in length: every compressed chunk carries a 16-bit tag of the whole
message's length in its header (`codec.layout.length_tag`), checked wherever a chunk is summed or
decoded: on the CPU on every call (a `WireFormatError` on the ranks that receive a chunk of
another length), on a GPU at each site's first call of each length (a check reads the headers: a
host sync). A plain call of another length is the backend's to notice (gloo aborts the process;
NCCL does not check): the agreement check below compares lengths on each site's first call only,
or on every call with ``TACO_CHECK_COLLECTIVES=1``.

Statistics (bytes sent, sampled error) are recorded per site (`stats`): the functions here record
under the ``site`` name in the process's ``stats.DEFAULT`` ledger, a `site.Site` in its own
table's. Each site's first call (every call with ``TACO_CHECK_COLLECTIVES=1``) first checks that
every rank makes the same call (`agreement`: a `CollectiveMismatch` on every rank otherwise),
and a transfer that outlives the group's timeout raises a `CollectiveTimeout` naming the site.
"""

from __future__ import annotations

import functools

import torch

from ..codec import CodecConfig
from ..codec.api import SUPPORTED_DTYPES, check_config
from ..codec.layout import length_tag
from ..errors import NonFiniteError, WireFormatError
from . import agreement, dist_ops
from .compressed import PIECES, Tally, acquire, release
from .dist_ops import DONE
from .pieces import PIECE_BYTES, Pipeline
from .stats import DEFAULT, SiteRecord, plain_bytes

_SAME_BYTES_EVERYWHERE = {"all_reduce": True, "reduce_scatter": False, "all_gather": True}


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


def _public(kind: str, x, group, config, site, async_op: bool, compress, inplace: bool, residual=None,
            piece_bytes: int = PIECE_BYTES):
    """The argument checks of the public functions; then `Pending`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kind} expects a torch.Tensor, got {type(x).__name__}")
    if config is not None:
        config = check_config(config, kind)
    if compress is None:
        compress = config is not None and x.numel() > 0
    elif not isinstance(compress, bool):
        raise TypeError(f"{kind}(compress={compress!r}): pass True, False or None (compressed when a config is given)")
    elif compress and config is None:
        raise ValueError(f"{kind}(compress=True) needs the codec settings: pass config=TacoConfig(...)")
    elif compress and x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{kind}(compress=True) of a {x.dtype} tensor: the codec encodes only {SUPPORTED_DTYPES} "
                        "(anything else would arrive inexact); leave compress=None, which sends it plain, or cast it")
    x = x.detach()
    link = dist_ops.link(group)
    check_shape(kind, x, link.world)
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 0:
        raise ValueError(f"{kind}(piece_bytes={piece_bytes!r}) must be an int >= 0 (bytes; 0: one piece)")
    name = site or kind
    pending = Pending(kind, x, link, config, compress, piece_bytes,
                      DEFAULT.record(name), name, inplace, check_residual(kind, x, residual))
    return pending if async_op else pending.wait()


# --- shared steps -----------------------------------------------------------------------------


def output_shape(kind: str, x: torch.Tensor, world: int) -> tuple[int, ...]:
    """Shape of the result of ``kind`` on this rank's ``x`` over ``world`` ranks."""
    if kind == "reduce_scatter":
        return (x.shape[0] // world, *x.shape[1:])
    if kind == "all_gather":
        return (x.shape[0] * world, *x.shape[1:])
    return tuple(x.shape)


def check_residual(kind: str, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """``residual`` if it can take x's error feedback (reduce_scatter or all_gather; float32,
    contiguous, x's number of values, on x's device); a TypeError or ValueError naming the fix."""
    if residual is None:
        return None
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{kind}(residual={type(residual).__name__}): pass a float32 tensor of x's size, or None")
    if kind == "all_reduce":
        raise ValueError("all_reduce takes no residual (the two-shot's second encoding, of the sum, is no rank's "
                         "input): for error feedback, reduce_scatter with residual= and then all_gather with residual=")
    if residual.dtype != torch.float32 or residual.numel() != x.numel() or not residual.is_contiguous() \
            or residual.device != x.device:
        raise ValueError(f"{kind}: residual must be a contiguous float32 tensor of {x.numel()} values on {x.device} "
                         f"(x's size), got {residual.dtype} {list(residual.shape)} on {residual.device}")
    return residual


def check_shape(kind: str, x: torch.Tensor, world: int) -> None:
    """reduce_scatter needs dim 0 divisible by ``world``; all_gather a dim 0."""
    if kind == "all_gather" and x.dim() == 0:
        raise ValueError("all_gather needs x with at least one dimension (got a 0-d tensor); use x.view(1)")
    if kind == "reduce_scatter" and (x.dim() == 0 or x.shape[0] % world):
        raise ValueError(
            f"reduce_scatter needs dim 0 of x (shape {list(x.shape)}) divisible by the group "
            f"size {world}; pad or trim dim 0 to a multiple of {world}"
        )


class Pending:
    """A collective in flight: `progress` lets compressed pieces advance between other work,
    `wait` returns the result (and records it in ``record``, the site's `stats.SiteRecord`).

    ``x`` is detached and its shape checked; ``link`` is the group's `dist_ops.Link`; ``codec``
    None or the `CodecConfig` (its ``nonfinite`` applies to the plain path too); ``compress``
    the caller's decision (taken plain anyway for one rank, an empty tensor or no codec).
    ``record=None``: no statistics and no agreement check (`autotune`'s timed calls).
    ``residual``: the error feedback of the module doc (checked by `check_residual`).

    The plain collective is one asynchronous call; the compressed one is a `Pipeline` of pieces,
    each `progress` one tick of it (codec work of one piece, the transfers of the others in
    flight). Every rank of the group must call `progress` as often, in the same order relative
    to other collectives.
    """

    __slots__ = ("kind", "x", "link", "codec", "record", "site", "out", "compressed", "nbytes", "_work",
                 "_pipeline", "_tally", "_buffers", "_exact_in", "_done")

    def __init__(self, kind: str, x: torch.Tensor, link, codec: CodecConfig | None, compress: bool,
                 piece_bytes: int, record: SiteRecord | None, site: str, inplace: bool = False,
                 residual: torch.Tensor | None = None) -> None:
        world = link.world
        nbytes = x.numel() * x.element_size()
        compressed = compress and codec is not None and world > 1 and nbytes > 0 and x.dtype in SUPPORTED_DTYPES
        self.kind, self.x, self.link, self.codec, self.record, self.site = kind, x, link, codec, record, site
        self.compressed, self.nbytes, self._done = compressed, nbytes, False
        if record is not None and agreement.due(record):  # the same calls on every rank: checked before any byte moves
            agreement.check(kind, x, link, codec, compressed, site, piece_bytes)
        owned = inplace and kind == "all_reduce" and x.is_contiguous()
        self._exact_in = None
        if compressed and record is not None and record.sample_due():
            self._exact_in = x.double()  # the input of the float64 reference, before x is decoded over
        self.out = out = x if owned else torch.empty(output_shape(kind, x, world), dtype=x.dtype, device=x.device)
        try:
            if compressed:
                self._tally = Tally(codec.nonfinite == "raise", length_tag(x.numel()),
                                    None if record is None else record.verified)
                self._buffers = acquire(x.device)  # send / receive / sum buffers reused from call to call
                pieces = PIECES[kind](x.contiguous(), out, wire_codec(codec), link, self._tally, self._buffers,
                                      piece_bytes, residual)
                self._pipeline = Pipeline.of(list(pieces))
                self._pipeline.tick()  # the first piece encoded and on the wire
            else:
                if residual is not None:
                    residual.zero_()  # the plain collective carries every value
                self._work = _plain(kind, x, out, link, codec)
        except Exception as error:
            self._fail(error)

    def progress(self) -> None:
        """One step of the compressed pipeline (nothing for a plain collective)."""
        if self.compressed and not self._done:
            try:
                self._done = not self._pipeline.tick()
            except Exception as error:
                self._fail(error)

    def result(self) -> tuple[torch.Tensor, int, bool]:
        """``(out, bytes this rank sent, compressed?)`` once complete; no statistics."""
        try:
            if self.compressed:
                self._pipeline.finish()
                release(self._buffers)
            else:
                self._work.wait()
        except Exception as error:
            self._fail(error)
        out, world = self.out, self.link.world
        raising = self.codec is not None and self.codec.nonfinite == "raise" and out.is_floating_point()
        if self.compressed:
            sent = self._tally.sent
            flag = self._tally.any_nonfinite() if raising else None
        else:
            sent = plain_bytes(self.kind, self.nbytes, world)
            flag = ~torch.isfinite(out).all() if raising else None
        if flag is not None:
            raise_if_flag(flag, self.link, self.site, agree=not _SAME_BYTES_EVERYWHERE[self.kind])
        return out, sent, self.compressed

    def wait(self) -> torch.Tensor:
        """The result; records the call under its site."""
        out, sent, compressed = self.result()
        record = self.record
        if record is not None:
            record.add(sent, plain_bytes(self.kind, self.nbytes, self.link.world), compressed)
            if self._exact_in is not None:
                exact = exact_result(self.kind, self._exact_in, out.shape, self.link)
                record.errors.append(relative_error(out, exact))
        return out

    def _fail(self, error: Exception):
        """Give the workspace back; raise ``error``, named after the site if it is a timeout."""
        if self.compressed and hasattr(self, "_buffers"):
            release(self._buffers)
        if isinstance(error, WireFormatError):
            raise WireFormatError(f"{self.site}: {error}") from error
        named = agreement.timeout_error(error, self.site, self.kind, self.link.group) \
            if isinstance(error, RuntimeError) else error
        if named is error:
            raise error
        raise named from error


def _plain(kind: str, x: torch.Tensor, out: torch.Tensor, link, codec: CodecConfig | None):
    """Start out <- the plain collective ``kind`` of x, in x's dtype; returns its work handle.

    For all_reduce ``out`` may be x itself (reduced in place)."""
    if codec is not None and codec.nonfinite == "zero" and x.is_floating_point():
        if kind == "all_reduce":
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)  # out may be x itself
        else:
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    if link.world == 1:
        if out is not x:
            out.copy_(x.view(out.shape))
        return DONE
    if kind == "all_reduce":
        if out is not x:
            out.copy_(x)
        return link.all_reduce(out)
    x = x.contiguous()
    if kind == "reduce_scatter":
        return link.reduce_scatter(out, x)
    return link.all_gather(out, x)


def wire_codec(codec: CodecConfig) -> CodecConfig:
    """The codec's settings on the wire: under "raise" the codec propagates and we raise after
    the transfer (on a flag every rank agrees on)."""
    return codec if codec.nonfinite != "raise" else _propagating(codec)


@functools.lru_cache(maxsize=64)
def _propagating(codec: CodecConfig) -> CodecConfig:
    return codec.replace(nonfinite="propagate")


def raise_if_flag(flag: torch.Tensor, link, site: str, *, agree: bool) -> None:
    """Raise NonFiniteError on every rank if ``flag`` (0-d bool) is set on any rank of ``link``'s group.

    ``agree=False`` when the flag is known to be identical on every rank (every rank holds the
    same bytes: all-reduce and all-gather, plain or compressed): no exchange.
    """
    if agree and link.world > 1:
        flag = flag.to(torch.int32).view(1)
        link.all_reduce(flag, "max").wait()
    if bool(flag.any()):  # the host sync that "raise" costs
        raise nonfinite_error(site)


def nonfinite_error(site: str) -> NonFiniteError:
    return NonFiniteError(
        f"{site}: a rank's input (or the sum) holds NaN or Inf, or a group of finite values too large "
        "for the codec's fp32 sums (max |x| past about 3.4e38 / G), under TacoConfig.nonfinite='raise'; "
        "find where the run diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
    )


def exact_result(kind: str, x: torch.Tensor, out_shape, link) -> torch.Tensor:
    """The float64 result of the plain collective of ``x`` (float64; one extra collective, for
    error sampling)."""
    ref = torch.empty(out_shape, dtype=torch.float64, device=x.device)
    _plain(kind, x.double(), ref, link, None).wait()
    return ref


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``||out - exact|| / ||exact||`` as a 0-d tensor (``||out - exact||`` when exact is 0)."""
    err, norm = (out.double() - exact).norm(), exact.norm()
    return torch.where(norm > 0, err / norm, err)
