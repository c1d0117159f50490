"""The collectives of a TP group emulated in one process: the same bytes, no torch.distributed.

An `EmulatedGroup` of P virtual ranks takes every rank's tensor as a list (index = rank) and
returns what the collectives of `collectives` return on a real group of P ranks::

    all_reduce(partials, config, site=)      -> the sum              (every rank holds these bytes)
    reduce_scatter(partials, config, site=)  -> [rank r's rows of the sum, for r in 0..P-1]
    all_gather(shards, config, site=)        -> the dim-0 concatenation (the same on every rank)

It takes the same decisions (a site's: its `policy.Compression` floor and piece size; the
``config=`` calls, the codec-level escape hatch: compressed whenever a config is given, pieces
of ``piece_bytes``) and runs the compressed path through the very piece generators of
`compressed`, one per virtual rank, advanced in lockstep: each virtual rank's ``link`` is an
`EmulatedRank` whose all-to-all and all-gather are fulfilled, once every rank has issued
them, by copying between the ranks' buffers. Given bit-identical inputs, the outputs are
therefore bit-identical to a real group's (tests/test_comm.py checks every collective, dtype
and odd size for P = 2, 3, 4), so a model emulated on one device or a laptop trains with the
numerics of real compressed TP. Results every rank holds alike (all_reduce, all_gather) are
decoded once, by rank 0. A message of one piece without error feedback (every TP message up to
``piece_bytes``) takes the shorter road of `stacked`: the ranks' tensors stacked, each codec
step once for all of them, the same bytes (tests/test_emulate.py checks both roads agree).

Statistics go to the site's `stats.SiteRecord` with the figures one rank of a real group would
record: bytes that rank sends, and the ring bytes of the plain collective. The plain path sums
the partials in rank order in their dtype; a real backend may add them in another order (for
P > 2), which changes the result by fp32 (or bf16) rounding only.

``reducer`` replaces the compressed all-reduce with another codec, for ablations that are not
a `TacoConfig` (``taco_accel.bench.convergence``: naive per-tensor FP8); see `Reducer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..codec import CodecConfig
from ..codec.api import SUPPORTED_DTYPES, check_config
from ..codec.layout import length_tag
from . import ops
from .collectives import check_residual, nonfinite_error, propagating_codec, relative_error
from .compressed import Tally, Workspace
from .kinds import KINDS, kind_of
from .pieces import PIECE_BYTES, Pipeline
from .stats import DEFAULT, SiteRecord

Reducer = Callable[[Sequence[torch.Tensor], CodecConfig], tuple[torch.Tensor, int]]
"""``(partials, codec) -> (sum, bytes one rank sends)``: a compressed all-reduce of P
same-shape, contiguous tensors (``codec.nonfinite`` is "propagate" or "zero")."""


class _Exchange:
    """The collectives the virtual ranks issue, matched by issue order: each rank's i-th call
    meets every other rank's i-th, and runs when the first of them is waited on (by then every
    rank has issued it: the ranks advance in lockstep)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.issued: list[list[tuple]] = [[] for _ in range(world)]
        self.done: set[int] = set()

    def issue(self, rank: int, op: str, out, x: torch.Tensor, root: int = 0) -> "_Work":
        self.issued[rank].append((op, out, x, root))
        return _Work(self, len(self.issued[rank]) - 1)

    def run(self, index: int) -> None:
        if index in self.done:
            return
        calls = [self.issued[r][index] for r in range(self.world)]
        world = self.world
        op, _, _, root = calls[0]
        if op == "broadcast":  # every rank's x <- the root's
            for r, (_, _, x, _) in enumerate(calls):
                if r != root:
                    x.copy_(calls[root][2])
        elif op == "gather":  # the root's out[p] <- rank p's x
            for p, (_, _, x, _) in enumerate(calls):
                calls[root][1][p].copy_(x)
        else:
            for r, (op, out, _, _) in enumerate(calls):
                rows = out.view(world, -1)
                for p, (_, _, x, _) in enumerate(calls):
                    rows[p].copy_(x.view(world, -1)[r] if op == "all_to_all" else x.view(-1))
        self.done.add(index)


class _Work:
    __slots__ = ("exchange", "index")

    def __init__(self, exchange: _Exchange, index: int) -> None:
        self.exchange, self.index = exchange, index

    def wait(self) -> bool:
        self.exchange.run(self.index)
        return True


class EmulatedRank:
    """Virtual rank ``rank`` of an exchange: the ``link`` the piece generators of `compressed` use."""

    __slots__ = ("exchange", "rank", "world")

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self.exchange, self.rank, self.world = exchange, rank, exchange.world

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor) -> _Work:
        return self.exchange.issue(self.rank, "all_to_all", out, x)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> _Work:
        return self.exchange.issue(self.rank, "all_gather", out, x)

    def broadcast(self, x: torch.Tensor, root: int) -> _Work:
        return self.exchange.issue(self.rank, "broadcast", None, x, root)

    def gather(self, out: list[torch.Tensor] | None, x: torch.Tensor, root: int) -> _Work:
        return self.exchange.issue(self.rank, "gather", out, x, root)


def run_compressed(kind: str, xs: list[torch.Tensor], outs: list[torch.Tensor | None], codec: CodecConfig,
                   piece_bytes: int, workspaces: list[Workspace],
                   residuals: Sequence[torch.Tensor] | None = None) -> int:
    """Every virtual rank's pieces of ``kind`` (`compressed`), advanced in lockstep; rank r reads
    ``xs[r]`` and decodes into ``outs[r]`` (None: not decoded), and fills ``residuals[r]`` (error
    feedback, reduce_scatter and all_gather). Returns the bytes one rank sends."""
    world = len(xs)
    exchange = _Exchange(world)
    tallies = [Tally(tag=length_tag(xs[0].numel())) for _ in range(world)]
    lost = residuals if residuals is not None else [None] * world
    pipelines = [
        Pipeline.of(list(KINDS[kind].pieces(x, out, codec, EmulatedRank(exchange, r), tally, workspace, piece_bytes,
                                      residual)))
        for r, (x, out, tally, workspace, residual) in enumerate(zip(xs, outs, tallies, workspaces, lost))
    ]
    live = True
    while live:
        live = False
        for pipeline in pipelines:
            live = pipeline.tick() or live
    return tallies[0].sent


def two_shot_all_reduce(partials: Sequence[torch.Tensor], config: CodecConfig,
                        piece_bytes: int = PIECE_BYTES) -> tuple[torch.Tensor, int]:
    """The TACO two-shot all-reduce of P partials (pieces of ``piece_bytes``); returns (sum, bytes
    per rank)."""
    xs = [p.contiguous() for p in partials]
    out = torch.empty_like(xs[0])
    sent = run_compressed("all_reduce", xs, [out] + [None] * (len(xs) - 1), config.codec, piece_bytes,
                          [Workspace() for _ in xs])
    return out, sent


class EmulatedGroup:
    """P virtual ranks in one process; every collective takes one tensor per rank (a list).

    ``reducer`` computes the compressed all-reduce (default: TACO's two-shot,
    `two_shot_all_reduce`); reduce_scatter and all_gather always use the TACO path.
    """

    def __init__(self, size: int, reducer: Reducer | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"EmulatedGroup(size={size!r}): use an int >= 1 (the tp degree)")
        self.size = size
        self.reducer = reducer or two_shot_all_reduce
        self._workspaces: dict[torch.device, list[Workspace]] = {}  # one per virtual rank: all are in flight
        self.handle = ops.register(self)  # how the compiled graph's op `taco::emulated` finds this group

    def __repr__(self) -> str:
        name = getattr(self.reducer, "__name__", repr(self.reducer))
        custom = "" if self.reducer is two_shot_all_reduce else f", reducer={name}"
        return f"EmulatedGroup(size={self.size}{custom})"

    def all_reduce(
        self, partials: Sequence[torch.Tensor], config: CodecConfig | None = None, *, site: str | None = None,
        piece_bytes: int = PIECE_BYTES,
    ) -> torch.Tensor:
        """The sum of every rank's tensor: a new tensor of their shape and dtype."""
        return self._public("all_reduce", partials, config, site, piece_bytes)

    def reduce_scatter(
        self, partials: Sequence[torch.Tensor], config: CodecConfig | None = None, *, site: str | None = None,
        piece_bytes: int = PIECE_BYTES,
    ) -> list[torch.Tensor]:
        """Each tensor has P*m rows along dim 0; returns ``[rank r's m rows of the sum]``."""
        return list(self._public("reduce_scatter", partials, config, site, piece_bytes).chunk(self.size))

    def all_gather(
        self, shards: Sequence[torch.Tensor], config: CodecConfig | None = None, *, site: str | None = None,
        piece_bytes: int = PIECE_BYTES,
    ) -> torch.Tensor:
        """Concatenation of every rank's tensor along dim 0, in rank order."""
        return self._public("all_gather", shards, config, site, piece_bytes)

    def collective(self, kind: str, xs: Sequence[torch.Tensor] | torch.Tensor, site,
                   residuals: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """``kind`` on every rank's tensor through the `site.Site` ``site``: its settings and
        decision (the size rule: there is no group to time), its statistics. ``xs``: one tensor
        per rank, or the ranks' tensors stacked along a new dim 0 ([P, ...]). reduce_scatter
        returns every rank's rows stacked in rank order. ``residuals``: one per rank, the error
        feedback of `collectives` (reduce_scatter, all_gather).

        Under torch.compile (stacked ``xs``, no residuals) the call is the custom op
        ``taco::emulated``: opaque to the tracer, so its Python (decision, statistics, codec
        layouts) costs no graph break and runs at run time, as `ops` does for real groups."""
        if isinstance(xs, torch.Tensor) and residuals is None and torch.compiler.is_compiling():
            return torch.ops.taco.emulated(xs, self.handle, site.handle, kind)
        together = xs.detach().contiguous() if isinstance(xs, torch.Tensor) else None
        xs = self._check(kind, together if together is not None else xs)
        for x in xs:
            site.observe(x)
        if residuals is not None:
            if len(residuals) != self.size:
                raise ValueError(f"{kind}: {len(residuals)} residuals for an EmulatedGroup of {self.size} ranks")
            residuals = [check_residual(kind, x, r) for x, r in zip(xs, residuals)]
        compress = site.compresses(kind, xs[0])
        return self._run(kind, xs, site.codec, compress, site.piece_bytes, site.entry, site.name, residuals, together)

    # -- shared steps -----------------------------------------------------------------------

    def _public(self, kind: str, xs, config, site: str | None, piece_bytes: int) -> torch.Tensor:
        xs = self._check(kind, xs)
        if config is not None:
            config = check_config(config, kind)
        compress = config is not None and xs[0].numel() > 0
        name = site or kind
        return self._run(kind, xs, config, compress, piece_bytes,
                         DEFAULT.record(name), name)

    def _check(self, kind: str, xs: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        if isinstance(xs, torch.Tensor):
            xs = xs.unbind(0) if xs.dim() > 0 else ()  # stacked: rank p's tensor at [p]
        if len(xs) != self.size or not all(isinstance(x, torch.Tensor) for x in xs):
            raise ValueError(
                f"{kind} on an EmulatedGroup of {self.size} ranks needs {self.size} tensors, got {len(xs)}"
            )
        first = xs[0]
        if any(x.shape != first.shape or x.dtype != first.dtype or x.device != first.device for x in xs):
            raise ValueError(f"{kind}: every rank's tensor must have one shape, dtype and device")
        kind_of(kind).check(first, self.size)
        return [x.detach().contiguous() for x in xs]

    def _run(self, kind: str, xs: list[torch.Tensor], codec: CodecConfig | None, compress: bool, piece_bytes: int,
             record: SiteRecord, site: str, residuals: list[torch.Tensor] | None = None,
             together: torch.Tensor | None = None) -> torch.Tensor:
        """The collective ``kind``, plain or compressed, as a tensor (reduce_scatter: all ranks'
        rows stacked in rank order); records the call like one rank would. ``together``: the
        ranks' tensors ``xs`` stacked, if the caller has them so."""
        nbytes = xs[0].numel() * xs[0].element_size()
        plain = KINDS[kind].plain_bytes(nbytes, self.size)
        if not (compress and codec is not None and self.size > 1 and nbytes > 0 and xs[0].dtype in SUPPORTED_DTYPES):
            if codec is not None and codec.nonfinite == "zero" and xs[0].is_floating_point():
                xs = [torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in xs]
            out = KINDS[kind].emulated_plain(xs)
            for residual in residuals or ():
                residual.zero_()  # the plain collective carries every value
            record.add(plain, plain, False)
        else:
            out, sent = self._compressed(kind, xs, propagating_codec(codec), piece_bytes, residuals, together)
            record.add(sent, plain, True)
            if record.sample_due():
                record.errors.append(relative_error(out, KINDS[kind].emulated_plain([x.double() for x in xs])))
        if codec is not None and codec.nonfinite == "raise" and not bool(torch.isfinite(out).all()):
            raise nonfinite_error(site)
        return out

    def _compressed(self, kind: str, xs: list[torch.Tensor], codec: CodecConfig, piece_bytes: int,
                    residuals: list[torch.Tensor] | None = None,
                    together: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        world, x, described = self.size, xs[0], KINDS[kind]
        if kind == "all_reduce" and self.reducer is not two_shot_all_reduce:
            return self.reducer(xs, codec)
        if described.stacked is not None and residuals is None and described.one_piece(x, codec, piece_bytes, world):
            together = torch.stack(xs) if together is None else together  # the codec once for all ranks
            return described.stacked(together, codec, length_tag(x.numel()), self._workspaces_on(x.device)[0])
        if not described.same_bytes:
            out = torch.empty_like(x)
            outs = list(out.view(world, -1).unbind(0))  # rank r decodes its rows
        else:
            out = x.new_empty(described.output_shape(x.shape, world))
            outs = [out] + [None] * (world - 1)  # the same bytes on every rank: rank 0 decodes them
        sent = run_compressed(kind, xs, outs, codec, piece_bytes, self._workspaces_on(x.device), residuals)
        return out, sent

    def _workspaces_on(self, device: torch.device) -> list[Workspace]:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return [Workspace() for _ in range(self.size)]  # a captured graph owns its buffers (its memory pool)
        found = self._workspaces.get(device)
        if found is None:
            found = self._workspaces[device] = [Workspace() for _ in range(self.size)]
        return found


@torch.library.custom_op("taco::emulated", mutates_args=())
def emulated(xs: torch.Tensor, group_handle: int, site_handle: int, kind: str) -> torch.Tensor:
    """`EmulatedGroup.collective` of the stacked ``xs`` [P, ...] through a site, as one op of a
    compiled graph (both found by their `ops` handles)."""
    return ops.route(group_handle).collective(kind, xs, ops.route(site_handle))


@emulated.register_fake
def _(xs, group_handle, site_handle, kind):
    described = KINDS[kind]
    if described.same_bytes:  # this rank's result (all_gather: every rank's tensor, concatenated)
        return xs.new_empty(described.output_shape(xs.shape[1:], xs.shape[0]))
    return xs.new_empty(xs.shape[1:])  # every rank's rows of the sum, in rank order
