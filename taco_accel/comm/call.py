"""One collective call, from its decision to its result: the one sequence of steps that every
collective takes (plain or compressed, whole or per rank, on a real group or an emulated one).

    call = Call(kind, x, link, codec, compress, piece_bytes, record, site)
    call.start(x)          # decided, checked, under way
    call.progress()        # compressed pieces advance while the caller computes
    out = call.wait()      # recorded, sampled, raised

The steps, in this order:

1. decide: compressed where the caller asks and `compresses` allows it (a codec, more than one
   rank, bytes to send, a dtype the codec encodes; anything else goes plain, exact);
2. check: on a site's first call (every call with ``TACO_CHECK_COLLECTIVES=1``) the ranks compare
   their calls before any byte moves (`agreement`);
3. transfer: plain, the kind's collective in the input dtype, with NaN and Inf as 0 under
   ``nonfinite="zero"`` (`finite`, the one place that zeroes them); compressed, the kind's pieces
   (`compressed`) on the link's reused `compressed.Workspace`, run by a `pieces.Pipeline`;
4. record: the bytes this rank sent against the plain ring bytes (`stats.ring_bytes`), in the
   site's `stats.SiteRecord` (the one place that records a collective);
5. sample: on the record's sampled calls (`stats.set_error_sampling`), the relative error against
   the plain collective of the input in float64 (one more collective);
6. raise: under ``nonfinite="raise"``, `NonFiniteError` on every rank when a rank's input (or the
   sum) holds NaN or Inf, decided on a flag every rank holds alike (a replicated result) or agreed
   by one MAX all-reduce, so that no rank is left waiting in a collective.

What differs per kind is `kinds.Kind`'s fields. The per-rank kinds are driven part by part:
`gather` then `landed` (each rank's part as it arrives), `scatter` then `submit` (each rank's
part as it is computed). An emulated group's call (`emulated.EmulatedCall`) takes its transfer,
its exact result and its non-finite flag from the emulation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..codec import CodecConfig
from ..codec.api import SUPPORTED_DTYPES, raise_mismatches
from ..codec.layout import length_tag
from ..errors import NonFiniteError, WireFormatError
from . import agreement
from .compressed import Message, acquire
from .dist_ops import DONE
from .kinds import Kind, gather_by_rank_plain, scatter_by_rank_plain
from .pieces import Pipeline
from .stats import SiteRecord, ring_bytes


def compresses(codec: CodecConfig | None, nbytes: int, dtype: torch.dtype, world: int | None = None) -> bool:
    """Whether a message of ``nbytes`` in ``dtype`` may travel compressed on a group of ``world``
    ranks (None: wherever it has peers): there are codec settings, peers, bytes, and a dtype the
    codec encodes (any other goes plain, exact). The one place this rule is written."""
    return codec is not None and nbytes > 0 and dtype in SUPPORTED_DTYPES and (world is None or world > 1)


def zeroes_nonfinite(codec: CodecConfig | None, x: torch.Tensor) -> bool:
    """Whether the NaN and Inf of the plain message ``x`` travel as 0 (``nonfinite="zero"``, floats)."""
    return codec is not None and codec.nonfinite == "zero" and x.is_floating_point()


def finite(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with NaN and Inf as 0, into ``out`` if given (may be x itself): the one place that
    zeroes them."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)


def propagating_codec(codec: CodecConfig) -> CodecConfig:
    """The codec's settings on a collective's wire: under "raise" the codec propagates (a
    non-finite group decodes to NaN) and the call raises after the transfer, on a flag every
    rank agrees on (a point-to-point message zeroes them instead: `p2p.zeroing_codec`)."""
    return codec if codec.nonfinite != "raise" else _propagating(codec)


@functools.lru_cache(maxsize=64)
def _propagating(codec: CodecConfig) -> CodecConfig:
    return codec.replace(nonfinite="propagate")


def nonfinite_error(site: str) -> NonFiniteError:
    return NonFiniteError(
        f"{site}: a rank's input (or the sum) holds NaN or Inf, or a group of finite values too large "
        "for the codec's fp32 sums (max |x| past about 3.4e38 / G), under TacoConfig.nonfinite='raise'; "
        "find where the run diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
    )


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``||out - exact|| / ||exact||`` as a 0-d tensor (``||out - exact||`` when exact is 0)."""
    err, norm = (out.double() - exact).norm(), exact.norm()
    return torch.where(norm > 0, err / norm, err)


class Parts(NamedTuple):
    """What a per-rank scatter's input will be, once its parts are submitted: the P parts one
    after another (P * part rows)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class Call:
    """One collective call in flight; see the module docstring.

    ``kind``: its `Kind`; ``x``: this rank's input, or what a per-rank scatter's will be (a
    `Parts`: its shape, dtype and device); ``link``: the group's `dist_ops.Link`; ``codec``:
    None or the `CodecConfig` (its ``nonfinite`` applies to the plain path too); ``compress``: the
    caller's decision (plain anyway where `compresses` says no); ``record``: the site's
    `stats.SiteRecord`, or None for no statistics and no agreement check (`autotune`'s timed
    calls). Every rank of the group makes the same calls on it, in the same order relative to
    other collectives."""

    __slots__ = ("kind", "link", "codec", "record", "site", "compressed", "nbytes", "piece_bytes", "out", "message",
                 "parts", "_transfer", "_workspace", "_exact_in", "_next", "_part", "_staged")

    def __init__(self, kind: Kind, x, link, codec: CodecConfig | None, compress: bool, piece_bytes: int,
                 record: SiteRecord | None, site: str) -> None:
        self.kind, self.link, self.codec, self.record, self.site = kind, link, codec, record, site
        shape, dtype = x.shape, x.dtype
        self.nbytes = nbytes = shape.numel() * dtype.itemsize
        self.compressed = compressed = compress and compresses(codec, nbytes, dtype, link.world)
        self.piece_bytes, self.out, self.message, self.parts = piece_bytes, None, None, None
        self._workspace = self._transfer = None
        if record is not None and agreement.due(record):  # before any byte moves
            self._check_agreement(shape, dtype, x.device)
        self._exact_in = [] if compressed and record is not None and record.sample_due() else None
        if compressed:
            self.message = Message(codec.nonfinite == "raise", length_tag(shape.numel()),
                                   None if record is None else record.header_flags)

    # -- the whole kinds: one tensor in, one result out ---------------------------------------

    def start(self, x: torch.Tensor, inplace: bool = False, residual: torch.Tensor | None = None) -> "Call":
        """Start the transfer of ``x`` (detached); ``inplace``: x is the caller's to give away (an
        all-reduce writes the result into it); ``residual``: error feedback (`collectives`)."""
        kind = self.kind
        if self._exact_in is not None:
            self._exact_in.append(x.double())  # the float64 reference's input, before x is decoded over
        in_place = inplace and kind.in_place and x.is_contiguous()
        self.out = out = x if in_place else x.new_empty(kind.output_shape(x.shape, self.link.world))
        try:
            if self.compressed:
                self._transfer = self._pieces(x.contiguous(), out, residual, x.device)
                self._transfer.tick()  # the first piece encoded and on the wire
            else:
                if residual is not None:
                    residual.zero_()  # the plain collective carries every value
                if zeroes_nonfinite(self.codec, x):
                    x = finite(x, out if kind.in_place else None)  # an all-reduce's out may be x itself
                self._transfer = self._plain(x, out)
        except Exception as error:
            self._fail(error)
        return self

    def progress(self) -> None:
        """One step of the compressed pipeline (nothing for a plain call or a per-rank kind)."""
        if self.compressed and not self.kind.per_rank:
            try:
                self._transfer.tick()
            except Exception as error:
                self._fail(error)

    def _plain(self, x: torch.Tensor, out: torch.Tensor):
        if self.link.world == 1:
            if out is not x:
                out.copy_(x.view(out.shape))
            return DONE
        return self.kind.plain(x, out, self.link)

    def _pieces(self, x, out: torch.Tensor | None, residual: torch.Tensor | None, device) -> Pipeline:
        self._workspace = acquire(self.link, device)  # send / receive / sum buffers reused from call to call
        return Pipeline.of(self.kind.pieces(x, out, propagating_codec(self.codec), self.link, self.message,
                                            self._workspace, self.piece_bytes, residual))

    # -- the per-rank kinds: one rank's part at a time ----------------------------------------

    def gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> "Call":
        """Start an all_gather_by_rank of ``x`` (contiguous) into ``out`` (contiguous, P *
        x.numel() values of x's dtype; a new ``(P, *x.shape)`` tensor if None): every rank's part
        on its way, this rank's in place. `landed` then yields the parts as they arrive."""
        world = self.link.world
        if out is None:
            out = x.new_empty((world, *x.shape))
        elif out.numel() != world * x.numel() or not out.is_contiguous() or out.dtype != x.dtype:
            self._fail(ValueError(
                f"{self.site}: gather_by_rank(out=) must be a contiguous {x.dtype} tensor of {world * x.numel()} "
                f"values ({world} parts of x's), got {out.dtype} {list(out.shape)}"))
        self.out = out
        self.parts = list(out.view(world, *x.shape).unbind(0)) if world > 1 else [out.view(x.shape)]
        if self._exact_in is not None:
            self._exact_in.append(x.double())
        try:
            if self.compressed:
                self._transfer = self._pieces(x, out, None, x.device)
            else:
                mine = self.parts[self.link.rank]
                finite(x, mine) if zeroes_nonfinite(self.codec, x) else mine.copy_(x)
                self._transfer = Pipeline.of([gather_by_rank_plain(self.parts, self.link)])
            self._transfer.tick()  # every rank's part on its way; this rank's in place
        except Exception as error:
            self._fail(error)
        return self

    def landed(self):
        """``(rank, part)`` as each part lands: this rank's first, then the others in rank order."""
        pipeline = self._transfer
        while True:
            yield pipeline.value, self.parts[pipeline.value]
            try:
                live = pipeline.tick()
            except Exception as error:
                self._fail(error)
            if not live:
                return

    def scatter(self, part_shape, dtype: torch.dtype, device) -> "Call":
        """Start a reduce_scatter_by_rank whose parts (of ``part_shape`` and ``dtype``, one for
        each rank) are `submit`-ted in rank order; `wait` then gives this rank's sum."""
        self.parts, self._next, self._staged = [None] * self.link.world, 0, False
        self._part = (torch.Size(part_shape), dtype, device)
        if self.compressed:
            self.out = torch.empty(part_shape, dtype=dtype, device=device)
            self._transfer = self._pieces(self.parts, self.out, None, device)
        else:
            self._workspace = acquire(self.link, device)  # its staging rows take the parts kept by the caller
            self._transfer = Pipeline.of([scatter_by_rank_plain(self.parts, self.link)])
        return self

    def submit(self, rank: int, part: torch.Tensor, inplace: bool = False) -> "Call":
        """Send this rank's ``part`` of rank ``rank``'s rows (ranks in order, 0 first);
        ``inplace``: the part is the caller's to give away (a temporary), which a plain reduction
        then works in instead of a copy."""
        shape, dtype, _ = self._part
        if rank != self._next or part.shape.numel() != shape.numel() or part.dtype != dtype:
            self._fail(ValueError(
                f"{self.site}: scatter_by_rank.submit({rank}, {part.dtype} {list(part.shape)}): submit each rank's "
                f"part once, in rank order (next: {self._next}), each of {list(shape)} values in {dtype}"))
        part = part.detach()
        if not part.is_contiguous():
            part, inplace = part.contiguous(), True
        if self._exact_in is not None:
            self._exact_in.append(part.double())
        if not self.compressed:
            part = self._staged_part(rank, part.view(-1), inplace)
        self.parts[rank] = part
        self._next += 1
        try:
            self._transfer.tick()
        except Exception as error:
            self._fail(error)
        return self

    def _staged_part(self, rank: int, part: torch.Tensor, inplace: bool) -> torch.Tensor:
        """What a plain reduction works in: the part itself when given away, else its row of the
        workspace's staging buffer (a reduction may overwrite its input on every rank)."""
        zero = zeroes_nonfinite(self.codec, part)
        if inplace:
            return finite(part, part) if zero else part
        shape, dtype, device = self._part
        stage = self._workspace.typed("stage", 0, (self.link.world, shape.numel()), dtype, device)[rank]
        if rank == self.link.rank:
            self._staged = True  # the sum lands in the staging buffer, the next call's: copied out
        return finite(part, stage) if zero else stage.copy_(part)

    # -- the end: record, sample, raise -------------------------------------------------------

    def wait(self) -> torch.Tensor:
        """The result, once every transfer is done; records the call, samples its error, and
        raises on non-finite values under ``nonfinite="raise"``."""
        if self.parts is not None and self.kind.scatters and self._next != self.link.world:
            self._fail(ValueError(f"{self.site}: scatter_by_rank.wait() after {self._next} of {self.link.world} "
                                  "parts: submit every rank's part first"))
        try:
            self._transfer.wait()
        except Exception as error:
            self._fail(error)
        out = self.out
        if out is None:  # a plain per-rank scatter: this rank's sum is where its part was reduced
            mine = self.parts[self.link.rank]
            out = self.out = (mine.clone() if self._staged else mine).view(self._part[0])
            self.parts = None
        self._release()
        kind, record = self.kind, self.record
        if record is not None:
            plain = ring_bytes(kind, self.nbytes, self.link.world)
            record.add(self.message.sent if self.compressed else plain, plain, self.compressed)
            if self._exact_in is not None:
                exact = self._exact()
                record.errors.append(relative_error(out.view(exact.shape), exact))
        codec = self.codec
        if codec is not None and codec.nonfinite == "raise" and out.is_floating_point():  # a host sync anyway
            if record is not None:
                raise_mismatches(record.header_flags, self.site)
            self._raise_if_nonfinite(out)
        return out

    def _exact(self) -> torch.Tensor:
        """The float64 result of the plain collective of the sampled input (one more collective)."""
        inputs = self._exact_in
        x = inputs[0] if len(inputs) == 1 else torch.cat([p.view(-1) for p in inputs])
        exact = x.new_empty(self.kind.output_shape(x.shape, self.link.world))
        self.kind.plain(x, exact, self.link).wait()
        return exact

    def _raise_if_nonfinite(self, out: torch.Tensor) -> None:
        """`NonFiniteError` on every rank if a rank's message held NaN or Inf: on the flag every
        rank holds alike (a replicated result), or agreed by one MAX all-reduce."""
        link = self.link
        flag = torch.stack(self.message.nonfinite_flags).any() if self.compressed else ~torch.isfinite(out).all()
        if not self.kind.replicated and link.world > 1:
            flag = flag.to(torch.int32).view(1)
            link.all_reduce(flag, "max").wait()
        if bool(flag.any()):  # the host sync that "raise" costs
            raise nonfinite_error(self.site)

    def _check_agreement(self, shape, dtype: torch.dtype, device) -> None:
        raise_mismatches(self.record.header_flags, self.site)  # a host sync anyway: the earlier calls' headers
        agreement.check(self.kind.name, shape, dtype, device, self.link, self.codec, self.compressed, self.site,
                        self.piece_bytes)

    def _release(self) -> None:
        if self._workspace is not None:
            self._workspace.busy = False
            self._workspace = None

    def _fail(self, error: Exception):
        """Give the workspace back; raise ``error``, named after the site (a wire-format error, a
        timeout)."""
        self._release()
        if isinstance(error, WireFormatError):
            raise WireFormatError(f"{self.site}: {error}") from error
        named = agreement.timeout_error(error, self.site, self.kind.name, self.link.group) \
            if isinstance(error, RuntimeError) else error
        if named is error:
            raise error
        raise named from error
