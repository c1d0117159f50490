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
from .compressed import Tally, acquire, all_gather_by_rank_piece, reduce_scatter_by_rank_piece, release
from .dist_ops import DONE
from .kinds import KINDS, kind_of
from .pieces import PIECE_BYTES, Pipeline
from .stats import DEFAULT, SiteRecord


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
    kind_of(kind).check(x, link.world)
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 0:
        raise ValueError(f"{kind}(piece_bytes={piece_bytes!r}) must be an int >= 0 (bytes; 0: one piece)")
    name = site or kind
    pending = Pending(kind, x, link, config, compress, piece_bytes,
                      DEFAULT.record(name), name, inplace, check_residual(kind, x, residual))
    return pending if async_op else pending.wait()


# --- shared steps -----------------------------------------------------------------------------


def check_residual(kind: str, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """``residual`` if it can take x's error feedback (reduce_scatter or all_gather; float32,
    contiguous, x's number of values, on x's device); a TypeError or ValueError naming the fix."""
    if residual is None:
        return None
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{kind}(residual={type(residual).__name__}): pass a float32 tensor of x's size, or None")
    if KINDS[kind].no_residual is not None:
        raise ValueError(KINDS[kind].no_residual)
    if residual.dtype != torch.float32 or residual.numel() != x.numel() or not residual.is_contiguous() \
            or residual.device != x.device:
        raise ValueError(f"{kind}: residual must be a contiguous float32 tensor of {x.numel()} values on {x.device} "
                         f"(x's size), got {residual.dtype} {list(residual.shape)} on {residual.device}")
    return residual


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
        described = KINDS[kind]
        owned = inplace and described.in_place and x.is_contiguous()
        self._exact_in = None
        if compressed and record is not None and record.sample_due():
            self._exact_in = x.double()  # the input of the float64 reference, before x is decoded over
        self.out = out = x if owned else torch.empty(described.output_shape(x.shape, world), dtype=x.dtype,
                                                     device=x.device)
        try:
            if compressed:
                self._tally = Tally(codec.nonfinite == "raise", length_tag(x.numel()),
                                    None if record is None else record.verified)
                self._buffers = acquire(link, x.device)  # send / receive / sum buffers reused from call to call
                pieces = described.pieces(x.contiguous(), out, propagating_codec(codec), link, self._tally,
                                          self._buffers, piece_bytes, residual)
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
            sent = KINDS[self.kind].plain_bytes(self.nbytes, world)
            flag = ~torch.isfinite(out).all() if raising else None
        if flag is not None:
            raise_if_flag(flag, self.link, self.site, agree=not KINDS[self.kind].same_bytes)
        return out, sent, self.compressed

    def wait(self) -> torch.Tensor:
        """The result; records the call under its site."""
        out, sent, compressed = self.result()
        record = self.record
        if record is not None:
            record.add(sent, KINDS[self.kind].plain_bytes(self.nbytes, self.link.world), compressed)
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

    For a kind ``in_place`` (all_reduce) ``out`` may be x itself (reduced in place)."""
    if codec is not None and codec.nonfinite == "zero" and x.is_floating_point():
        if KINDS[kind].in_place:
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)  # out may be x itself
        else:
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    if link.world == 1:
        if out is not x:
            out.copy_(x.view(out.shape))
        return DONE
    return KINDS[kind].plain(x, out, link)


def propagating_codec(codec: CodecConfig) -> CodecConfig:
    """The codec's settings on a collective's wire: under "raise" the codec propagates (a
    non-finite group decodes to NaN) and the call raises after the transfer, on a flag every
    rank agrees on (a point-to-point message zeroes them instead: `p2p.zeroing_codec`)."""
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


# --- the per-rank kinds: all_gather / reduce_scatter cut per rank, for compute overlap --------


class _PerRankCall:
    """What the per-rank handles share: on a failure, the workspace goes back to its link and a
    wire-format error is named after the site (timeouts are named where they are waited on)."""

    _buffers = None

    def _fail(self, error: Exception):
        if self._buffers is not None:
            release(self._buffers)
            self._buffers = None
        if isinstance(error, WireFormatError):
            raise WireFormatError(f"{self.site}: {error}") from error
        raise error


class GatherByRank(_PerRankCall):
    """``all_gather_by_rank`` in flight: every rank's ``x`` into ``out``, one rank's part at a
    time, so that compute can follow each part as it lands (the decomposition of PyTorch's async
    TP and Megatron's TP overlap)::

        parts = site.gather_by_rank(x, out=full)   # every rank's part on its way
        for rank, part in parts.landed():           # this rank's first, then the others in rank order
            y[rank] = part @ w                       # computes while the next part travels
        parts.wait()                                # statistics; nonfinite="raise"; the workspace back

    ``out``: contiguous, P * x.numel() values (part r: the r-th block of its memory; a new
    ``(P, *x.shape)`` tensor if None); each part a view of it of x's shape. Compressed, each
    rank's part travels as one wire buffer of whole groups (`compressed.all_gather_by_rank_piece`,
    on the `Workspace` and `Pipeline` of every compressed call): the same bytes as `all_gather`
    of the parts. Plain: one broadcast per rank, straight into ``out``. Recorded under the site
    as one call."""

    kind = "all_gather_by_rank"

    def __init__(self, x: torch.Tensor, link, codec: CodecConfig | None, compress: bool, piece_bytes: int,
                 record: SiteRecord | None, site: str, out: torch.Tensor | None = None) -> None:
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        world = link.world
        self.x, self.link, self.codec, self.record, self.site = x, link, codec, record, site
        self.nbytes = x.numel() * x.element_size()
        self.compressed = compress and codec is not None and world > 1 and self.nbytes > 0 \
            and x.dtype in SUPPORTED_DTYPES
        if record is not None and agreement.due(record):  # before any byte moves
            agreement.check(self.kind, x, link, codec, self.compressed, site, piece_bytes)
        if out is None:
            out = x.new_empty((world, *x.shape))
        elif out.numel() != world * x.numel() or not out.is_contiguous() or out.dtype != x.dtype:
            raise ValueError(f"{site}: gather_by_rank(out=) must be a contiguous {x.dtype} tensor of "
                             f"{world * x.numel()} values ({world} parts of x's), got {out.dtype} {list(out.shape)}")
        self.out = out
        self.parts = list(out.view(world, *x.shape).unbind(0)) if world > 1 else [out.view(x.shape)]
        self._exact_in = x.double() if self.compressed and record is not None and record.sample_due() else None
        self._buffers = None
        try:
            if self.compressed:
                self._tally = Tally(codec.nonfinite == "raise", length_tag(x.numel()),
                                    None if record is None else record.verified)
                self._buffers = acquire(link, x.device)
                step = all_gather_by_rank_piece(x, out, propagating_codec(codec), link, self._tally, self._buffers)
            else:
                step = _gather_by_rank_plain(x, self.parts, link, codec)
            self._pipeline = Pipeline.of([step])
            self._live = self._pipeline.tick()  # every broadcast issued; this rank's part in place
        except Exception as error:
            self._fail(error)

    def landed(self):
        """``(rank, part)`` as each part lands: this rank's first, then the others in rank order."""
        pipeline = self._pipeline
        yield pipeline.value, self.parts[pipeline.value]
        with agreement.named_timeouts(self.site, f"{self.kind} (per rank)", self.link.group):
            while True:
                try:
                    self._live = pipeline.tick()
                except Exception as error:
                    self._fail(error)
                if not self._live:
                    return
                yield pipeline.value, self.parts[pipeline.value]

    def wait(self) -> torch.Tensor:
        """``out``, every part landed; records the call, checks "raise", gives the workspace back."""
        try:
            with agreement.named_timeouts(self.site, f"{self.kind} (per rank)", self.link.group):
                self._pipeline.finish()
        except Exception as error:
            self._fail(error)
        if self._buffers is not None:
            release(self._buffers)
            self._buffers = None
        world, out = self.link.world, self.out
        uncompressed = KINDS[self.kind].plain_bytes(self.nbytes, world)
        sent = self._tally.sent if self.compressed else uncompressed
        if self.record is not None:
            self.record.add(sent, uncompressed, self.compressed)
            if self._exact_in is not None:
                exact = exact_result(self.kind, self._exact_in.view(1, -1), (world, self.x.numel()), self.link)
                self.record.errors.append(relative_error(out.view(world, -1), exact))
        if self.codec is not None and self.codec.nonfinite == "raise" and out.is_floating_point():
            flag = self._tally.any_nonfinite() if self.compressed else ~torch.isfinite(out).all()
            raise_if_flag(flag, self.link, self.site, agree=False)  # the same bytes on every rank
        return out


def _gather_by_rank_plain(x: torch.Tensor, parts: list[torch.Tensor], link, codec: CodecConfig | None):
    """The plain all_gather_by_rank: this rank's x into its part, one broadcast per rank into
    ``parts``; yields each rank as its part lands (this rank's first)."""
    world, rank = link.world, link.rank
    if codec is not None and codec.nonfinite == "zero" and x.is_floating_point():
        torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=parts[rank])
    else:
        parts[rank].copy_(x)
    works = [link.broadcast(parts[r], r) for r in range(world)] if world > 1 else [DONE]
    yield rank
    for r in (*range(rank), *range(rank + 1, world)):
        works[r].wait()
        yield r
    works[rank].wait()


class ScatterByRank(_PerRankCall):
    """``reduce_scatter_by_rank`` in flight: this rank's part of each rank's rows submitted in
    rank order, each sent (a reduction to its rank) while the next is computed::

        sums = site.scatter_by_rank(shape, dtype, device)
        for rank in range(P):
            sums.submit(rank, partial_for(rank))     # computed, then on its way
        mine = sums.wait()                           # the sum over ranks of this rank's part

    Every rank submits parts of ``shape`` and ``dtype`` for ranks 0..P-1 in order; ``owned=True``
    gives the part away (a temporary): the plain reduction then works in it instead of a copy
    into the workspace. Compressed: each part one wire buffer of whole groups, gathered to its
    rank and summed there in rank order (`compressed.reduce_scatter_by_rank_piece`): the same
    bytes as `reduce_scatter` of the stacked parts. Plain: one reduction per rank (the sum's
    order may differ from reduce_scatter's by fp32 rounding for P > 2). Recorded under the site
    as one call."""

    kind = "reduce_scatter_by_rank"

    def __init__(self, shape, dtype: torch.dtype, device, link, codec: CodecConfig | None, compress: bool,
                 piece_bytes: int, record: SiteRecord | None, site: str) -> None:
        world = link.world
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        self.link, self.codec, self.record, self.site, self.piece_bytes = link, codec, record, site, piece_bytes
        self.nbytes = world * self.shape.numel() * dtype.itemsize  # the whole input: P parts
        self.compressed = compress and codec is not None and world > 1 and self.nbytes > 0 \
            and dtype in SUPPORTED_DTYPES
        self.parts: list = [None] * world
        self._owned = [False] * world
        self._next = 0
        self._exact: list | None = None
        self._buffers = acquire(link, self.device)
        self.out = None
        if self.compressed:
            self._tally = Tally(codec.nonfinite == "raise", length_tag(world * self.shape.numel()),
                                None if record is None else record.verified)
            self.out = torch.empty(self.shape, dtype=dtype, device=self.device)
            step = reduce_scatter_by_rank_piece(self.parts, self.out, propagating_codec(codec), link, self._tally,
                                                self._buffers)
        else:
            step = self._plain()
        self._pipeline = Pipeline.of([step])

    def submit(self, rank: int, part: torch.Tensor, owned: bool = False) -> "ScatterByRank":
        """Send this rank's ``part`` of rank ``rank``'s rows (ranks in order, 0 first)."""
        if rank != self._next or part.shape.numel() != self.shape.numel() or part.dtype != self.dtype:
            self._fail(ValueError(
                f"{self.site}: scatter_by_rank.submit({rank}, {part.dtype} {list(part.shape)}): submit each rank's "
                f"part once, in rank order (next: {self._next}), each of {list(self.shape)} values in {self.dtype}"))
        part = part.detach()
        if not part.is_contiguous():
            part, owned = part.contiguous(), True
        if rank == 0:
            record = self.record
            if record is not None and agreement.due(record):
                agreement.check(self.kind, part, self.link, self.codec, self.compressed, self.site, self.piece_bytes)
            if self.compressed and record is not None and record.sample_due():
                self._exact = []
        if self._exact is not None:
            self._exact.append(part.double())
        self.parts[rank], self._owned[rank] = part, owned
        self._next += 1
        try:
            self._pipeline.tick()
        except Exception as error:
            self._fail(error)
        return self

    def progress(self) -> None:
        """Nothing to advance between parts (the `Pending` interface)."""

    def wait(self) -> torch.Tensor:
        """The sum over ranks of this rank's parts, of ``shape``; records the call."""
        if self._next != self.link.world:
            self._fail(ValueError(f"{self.site}: scatter_by_rank.wait() after {self._next} of "
                                  f"{self.link.world} parts: submit every rank's part first"))
        try:
            with agreement.named_timeouts(self.site, f"{self.kind} (per rank)", self.link.group):
                self._pipeline.finish()
        except Exception as error:
            self._fail(error)
        release(self._buffers)
        self._buffers = None
        out, world = self.out.view(self.shape), self.link.world
        uncompressed = KINDS[self.kind].plain_bytes(self.nbytes, world)
        sent = self._tally.sent if self.compressed else uncompressed
        if self.record is not None:
            self.record.add(sent, uncompressed, self.compressed)
            if self._exact is not None:
                exact = exact_result(self.kind, torch.stack(self._exact), (1, self.shape.numel()), self.link)
                self.record.errors.append(relative_error(out.view(1, -1), exact))
        if self.codec is not None and self.codec.nonfinite == "raise" and out.is_floating_point():
            flag = self._tally.any_nonfinite() if self.compressed else ~torch.isfinite(out).all()
            raise_if_flag(flag, self.link, self.site, agree=True)  # each rank holds other sums
        return out

    def _plain(self):
        """One reduction per rank: in the part itself when it is given away, else in its row of
        the workspace's staging buffer; yields each rank as its reduction is issued."""
        link, codec = self.link, self.codec
        world, rank, numel = link.world, link.rank, self.shape.numel()
        zero = codec is not None and codec.nonfinite == "zero" and self.dtype.is_floating_point
        works = []
        for r in range(world):
            part = self.parts[r].view(-1)
            self.parts[r] = None
            if not self._owned[r]:  # a reduction may overwrite its input on every rank: a copy
                stage = self._buffers.typed("stage", 0, (world, numel), self.dtype, self.device)[r]
                part = torch.nan_to_num(part, nan=0.0, posinf=0.0, neginf=0.0, out=stage) if zero else stage.copy_(part)
            elif zero:
                torch.nan_to_num(part, nan=0.0, posinf=0.0, neginf=0.0, out=part)
            works.append(link.reduce(part, r) if world > 1 else DONE)
            if r == rank:
                mine, owned = part, self._owned[r]
            yield r
        for work in works:
            work.wait()
        self.out = mine if owned else mine.clone()  # the staging buffer is the next call's
