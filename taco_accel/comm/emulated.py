"""The collectives of a TP group emulated in one process: the same bytes, no torch.distributed.

An `EmulatedGroup` of P virtual ranks takes every rank's tensor as a list (index = rank) and
returns what the collectives of `collectives` return on a real group of P ranks::

    all_reduce(partials, config, site=)      -> the sum              (every rank holds these bytes)
    reduce_scatter(partials, config, site=)  -> [rank r's rows of the sum, for r in 0..P-1]
    all_gather(shards, config, site=)        -> the dim-0 concatenation (the same on every rank)

Each call is a `call.Call` (`EmulatedCall`): the same decision (a site's: its
`policy.Compression` floor and piece size; the ``config=`` calls, the codec-level escape hatch:
compressed whenever a config is given, pieces of ``piece_bytes``), statistics, error sampling
and non-finite rule as a real group's, with the transfer done here. The compressed path runs the
very piece generators of `compressed`, one per virtual rank, advanced in lockstep: each virtual
rank's ``link`` is an `EmulatedRank` whose collectives are fulfilled, once every rank has issued
them, by copying between the ranks' buffers. Given bit-identical inputs, the outputs are
therefore bit-identical to a real group's (tests/test_comm.py checks every collective, dtype
and odd size for P = 2, 3, 4), so a model emulated on one device or a laptop trains with the
numerics of real compressed TP. Results every rank holds alike (all_reduce, all_gather) are
decoded once, by rank 0. A message of one piece without error feedback (every TP message up to
``piece_bytes``, and every message of the per-rank kinds) takes the shorter road of `stacked`:
the ranks' tensors stacked, each codec step once for all of them, the same bytes
(tests/test_emulate.py checks both roads agree).

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
from ..codec.api import check_config
from ..codec.layout import length_tag
from . import ops, stacked
from .call import Call, finite, nonfinite_error, propagating_codec, zeroes_nonfinite
from .collectives import check_residual
from .compressed import Message, Workspace
from .copies import SharesGroup
from .dist_ops import DONE
from .kinds import Kind, kind_of
from .pieces import PIECE_BYTES, Pipeline
from .stats import DEFAULT

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
    """Every virtual rank's pieces of the kind named ``kind`` (`compressed`), advanced in lockstep;
    rank r reads ``xs[r]`` and decodes into ``outs[r]`` (None: not decoded), and fills
    ``residuals[r]`` (error feedback, reduce_scatter and all_gather). Returns the bytes one rank
    sends."""
    world, pieces = len(xs), kind_of(kind).pieces
    exchange = _Exchange(world)
    messages = [Message(tag=length_tag(xs[0].numel())) for _ in range(world)]
    lost = residuals if residuals is not None else [None] * world
    pipelines = [
        Pipeline.of(pieces(x, out, codec, EmulatedRank(exchange, r), message, workspace, piece_bytes, residual))
        for r, (x, out, message, workspace, residual) in enumerate(zip(xs, outs, messages, workspaces, lost))
    ]
    live = True
    while live:
        live = False
        for pipeline in pipelines:
            live = pipeline.tick() or live
    return messages[0].sent


def _sends_in_one_piece(kind: Kind, x: torch.Tensor, codec: CodecConfig, piece_bytes: int, world: int) -> bool:
    """Whether ``kind`` sends ``x`` in one piece: its pieces of a rank, made without starting them,
    say so."""
    rank = EmulatedRank(_Exchange(world), 0)
    return len(kind.pieces(x, None, codec, rank, None, None, piece_bytes)) == 1


def plain_result(kind: Kind, xs: list[torch.Tensor]) -> torch.Tensor:
    """The plain collective of every rank's tensor, in their dtype: the sum in rank order
    (reduce_scatter: every rank's rows of it, stacked), or the concatenation."""
    if not kind.reduces:
        return torch.cat(xs)
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out


class EmulatedGroup(SharesGroup):
    """P virtual ranks in one process; every collective takes one tensor per rank (a list).

    ``reducer`` computes the compressed all-reduce (None: TACO's two-shot); reduce_scatter and
    all_gather always use the TACO path. A copy (``copy.deepcopy`` of an emulated model) is a
    group of its own: its own handle, which its compiled graphs' ``taco::emulated`` op finds, and
    its own workspaces.
    """

    _fresh = ("handle", "_workspaces")

    def __init__(self, size: int, reducer: Reducer | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"EmulatedGroup(size={size!r}): use an int >= 1 (the tp degree)")
        self.world = size  # the number of virtual ranks (a `call.Call`'s link size)
        self.reducer = reducer
        self._renew()

    def _copied(self, original: "EmulatedGroup") -> None:
        self._renew()

    def _renew(self) -> None:
        """This group's own workspaces and handle (a new group, or a copy)."""
        self._workspaces: dict[torch.device, list[Workspace]] = {}  # one per virtual rank: all are in flight
        self.handle = ops.register(self)  # how the compiled graph's op `taco::emulated` finds this group

    def __repr__(self) -> str:
        name = getattr(self.reducer, "__name__", repr(self.reducer))
        custom = "" if self.reducer is None else f", reducer={name}"
        return f"EmulatedGroup(size={self.world}{custom})"

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
        return list(self._public("reduce_scatter", partials, config, site, piece_bytes).chunk(self.world))

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
        ``taco::emulated`` (`ops`): opaque to the tracer, so its Python (decision, statistics,
        codec layouts) costs no graph break and runs at run time, as for real groups."""
        if isinstance(xs, torch.Tensor) and residuals is None and torch.compiler.is_compiling():
            return torch.ops.taco.emulated(xs, self.handle, site.handle_tensor, kind)
        described = kind_of(kind)
        together = xs.detach().contiguous() if isinstance(xs, torch.Tensor) else None
        xs = self._check(described, together if together is not None else xs)
        for x in xs:
            site.observe(x)
        if residuals is not None:
            if len(residuals) != self.world:
                raise ValueError(f"{kind}: {len(residuals)} residuals for an EmulatedGroup of {self.world} ranks")
            residuals = [check_residual(described, x, r) for x, r in zip(xs, residuals)]
        call = EmulatedCall(described, xs[0], self, site.config, site.compresses(kind, xs[0]), site.piece_bytes,
                            site.record, site.name)
        return call.run(xs, residuals, together).wait()

    def _public(self, kind: str, xs, config, site: str | None, piece_bytes: int) -> torch.Tensor:
        described = kind_of(kind)
        xs = self._check(described, xs)
        if config is not None:
            config = check_config(config, kind)
        name = site or kind
        call = EmulatedCall(described, xs[0], self, config, True, piece_bytes, DEFAULT.record(name), name)
        return call.run(xs).wait()

    def _check(self, kind: Kind, xs: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        if isinstance(xs, torch.Tensor):
            xs = xs.unbind(0) if xs.dim() > 0 else ()  # stacked: rank p's tensor at [p]
        if len(xs) != self.world or not all(isinstance(x, torch.Tensor) for x in xs):
            raise ValueError(
                f"{kind.name} on an EmulatedGroup of {self.world} ranks needs {self.world} tensors, got {len(xs)}"
            )
        first = xs[0]
        if any(x.shape != first.shape or x.dtype != first.dtype or x.device != first.device for x in xs):
            raise ValueError(f"{kind.name}: every rank's tensor must have one shape, dtype and device")
        kind.check(first, self.world)
        return [x.detach().contiguous() for x in xs]

    def compressed(self, kind: Kind, xs: list[torch.Tensor], codec: CodecConfig, piece_bytes: int,
                   residuals: list[torch.Tensor] | None = None,
                   together: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The compressed ``kind`` of every rank's tensor: (the result, bytes one rank sends)."""
        world, x = self.world, xs[0]
        if self.reducer is not None and kind.name == "all_reduce":
            return self.reducer(xs, codec)
        if kind.replicated:
            out = x.new_empty(kind.output_shape(x.shape, world))
            outs = [out] + [None] * (world - 1)  # the same bytes on every rank: rank 0 decodes them
        else:
            out = torch.empty_like(x)
            outs = list(out.view(world, -1).unbind(0))  # rank r decodes its rows
        if residuals is None and _sends_in_one_piece(kind, x, codec, piece_bytes, world):  # the codec once for all ranks
            together = torch.stack(xs) if together is None else together
            return stacked.run(kind, together, codec, length_tag(x.numel()), self._workspaces_on(x.device)[0])
        return out, run_compressed(kind.name, xs, outs, codec, piece_bytes, self._workspaces_on(x.device), residuals)

    def _workspaces_on(self, device: torch.device) -> list[Workspace]:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return [Workspace() for _ in range(self.world)]  # a captured graph owns its buffers (its memory pool)
        found = self._workspaces.get(device)
        if found is None:
            found = self._workspaces[device] = [Workspace() for _ in range(self.world)]
        return found


class EmulatedCall(Call):
    """A `call.Call` of an `EmulatedGroup` (its ``link``): every virtual rank's tensor at once, its
    result at once. The virtual ranks make one call, so there is no agreement to check; the exact
    result of a sampled call and the non-finite flag come from every rank's tensor in hand."""

    __slots__ = ()

    def run(self, xs: list[torch.Tensor], residuals: list[torch.Tensor] | None = None,
            together: torch.Tensor | None = None) -> "EmulatedCall":
        """The transfer of every rank's ``xs`` (``together``: them stacked, if at hand); its
        result (reduce_scatter: all ranks' rows stacked in rank order) is `wait`'s."""
        kind, codec, group = self.kind, self.codec, self.link
        if self._exact_in is not None:
            self._exact_in.extend(xs)  # never decoded over: no copy needed
        if not self.compressed:
            if zeroes_nonfinite(codec, xs[0]):
                xs = [finite(x) for x in xs]
            self.out = plain_result(kind, xs)
            for residual in residuals or ():
                residual.zero_()  # the plain collective carries every value
        else:
            self.out, self.message.sent = group.compressed(kind, xs, propagating_codec(codec), self.piece_bytes,
                                                           residuals, together)
        self._transfer = DONE
        return self

    def _exact(self) -> torch.Tensor:
        return plain_result(self.kind, [x.double() for x in self._exact_in])

    def _raise_if_nonfinite(self, out: torch.Tensor) -> None:
        if not bool(torch.isfinite(out).all()):  # every rank's result in hand: no flag to agree on
            raise nonfinite_error(self.site)

    def _check_agreement(self, shape, dtype: torch.dtype, device) -> None:
        """Every virtual rank makes this one call: nothing to compare."""
