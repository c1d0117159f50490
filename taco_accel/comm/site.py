"""`Site`: one named call point of a collective, with its group, codec settings, decision and
statistics.

A site is named after what it moves (layer 3 names them after the module and the direction:
``layers.3.mlp.down_proj/fwd``). It holds:

- its process group (and the group's `dist_ops.Link`, built on first use);
- ``config``: a `TacoConfig` (codec settings) or None (always plain). Mutable on purpose:
  calibration and ``SiteTable.load`` change the group size of a running model;
- ``threshold_bytes`` and ``piece_bytes``, its `policy.Compression`'s size floor and piece size;
- how it decides plain or compressed per call (`compresses`): a message under the
  ``threshold_bytes`` floor (default 0) is plain; any other is compressed, or with a ``decider``
  (the auto mode, `autotune.AutoDecider`) compressed where the timing of its first call says so
  (kept as ``decision``; with no group to time, the auto mode's size rule). The decision is
  passed down to the collective explicitly;
- ``record``: its `stats.SiteRecord` in a `stats.Ledger` (the model's, or ``stats.DEFAULT``):
  its statistics, error sampling and agreement checks;
- ``samples``: what it sends, kept while a calibration records.

`collective` runs it: eagerly `run` (a `call.Call`), or inside torch.compile the custom op of
`ops`, which finds the site by its ``handle`` and calls `run` at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codec import CodecConfig, TacoConfig
from . import dist_ops, ops
from .call import Call, Parts, compresses
from .collectives import check_residual
from .copies import SharesGroup
from .kinds import kind_of
from .pieces import PIECE_BYTES
from .stats import DEFAULT, Ledger


class Site(SharesGroup):
    """One communication site; see the module docstring."""

    __slots__ = ("name", "group", "world", "handle", "handle_tensor", "decider", "decision", "record", "samples", "_max_elements",
                 "_config", "piece_bytes", "threshold_bytes", "_link", "__weakref__")

    def __init__(self, name: str, group, config: TacoConfig | None, decider=None, ledger: Ledger | None = None,
                 *, threshold_bytes: int = 0, piece_bytes: int = PIECE_BYTES):
        self.name, self.group, self.decider, self.decision = name, group, decider, None
        self.threshold_bytes, self.piece_bytes = threshold_bytes, piece_bytes
        self.world = dist_ops.group_size(group)
        self.record = (ledger or DEFAULT).record(name)
        self.handle = ops.register(self)  # how the compiled graph's custom ops find this site
        self.handle_tensor = ops.handle_tensor(self.handle)  # ... passed as a graph input (`ops`)
        self.config = config
        self.samples: list[torch.Tensor] | None = None  # a list only while calibrating
        self._max_elements = 0
        self._link = None
        if decider is not None:
            decider.sites.append(self)

    def _copied(self, original: "Site") -> None:
        """A copied model's site: its own handle, statistics starting at zero."""
        self.handle = ops.register(self)
        self.handle_tensor = ops.handle_tensor(self.handle)
        self.record.pop()

    @property
    def config(self) -> TacoConfig | None:
        return self._config

    @config.setter
    def config(self, value: TacoConfig | None) -> None:
        if value is not None and not isinstance(value, CodecConfig):
            raise TypeError(f"Site {self.name!r}: config={value!r} must be a TacoConfig or None")
        self._config = value

    @property
    def link(self):
        """The `dist_ops.Link` of this site's group (built on first use)."""
        if self._link is None:
            self._link = dist_ops.link(self.group)
        return self._link

    def collective(self, kind: str, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Send ``x`` through the collective ``kind`` ("all_reduce", "all_gather",
        "reduce_scatter") from this site: `run`, or inside torch.compile the custom op that
        calls `run` at run time (`ops`: the collective stays in the graph, out of place)."""
        if torch.compiler.is_compiling():
            return ops.OPS[kind](x, self.handle_tensor, self.world)
        return self.run(kind, x, inplace=inplace)

    def run(self, kind: str, x: torch.Tensor, *, inplace: bool = False, async_op: bool = False,
            residual: torch.Tensor | None = None):
        """The collective, eagerly: calibration sample, decision, statistics. ``inplace``: x is
        the caller's to give away (all_reduce writes the sum into it). ``async_op``: the
        `call.Call` in flight. ``residual``: error feedback (reduce_scatter, all_gather: see
        `collectives`)."""
        if x.requires_grad:
            x = x.detach()
        if self.samples is not None:
            self.observe(x)
        link = self._link or self.link
        described = kind_of(kind)
        described.check(x, link.world)
        if self.decider is None:  # the size floor, inline: this is every plain site's path
            compress = not self.threshold_bytes or x.numel() * x.element_size() >= self.threshold_bytes
        else:
            compress = self.compresses(kind, x)
        call = Call(described, x, link, self._config, compress, self.piece_bytes, self.record, self.name)
        call.start(x, inplace, check_residual(described, x, residual))
        return call if async_op else call.wait()

    def gather_by_rank(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Call:
        """The all-gather of every rank's ``x`` into ``out``, one rank's part at a time
        (``.landed()`` yields ``(rank, part)`` as each lands, ``.wait()`` ends the call): the
        kind ``all_gather_by_rank`` (`call.Call.gather`), on this site's settings and decision
        (taken for the whole all-gather) and recorded in its ledger."""
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        return Call(kind_of("all_gather_by_rank"), x, self._link or self.link, self._config,
                    self.compresses("all_gather", x), self.piece_bytes, self.record, self.name).gather(x, out)

    def scatter_by_rank(self, shape, dtype: torch.dtype, device) -> Call:
        """A reduce-scatter whose parts (each rank's rows, of ``shape`` and ``dtype``) are
        submitted one destination rank at a time (``.submit(rank, part)``, ``.wait()``): the kind
        ``reduce_scatter_by_rank`` (`call.Call.scatter`), on this site's settings and decision
        (taken for the whole reduce-scatter, P parts) and recorded in its ledger."""
        link = self._link or self.link
        parts = Parts(torch.Size((link.world * shape[0], *shape[1:])), dtype, torch.device(device))
        compress = self.compresses_like("reduce_scatter", parts.shape, dtype, device)
        return Call(kind_of("reduce_scatter_by_rank"), parts, link, self._config, compress, self.piece_bytes,
                    self.record, self.name).scatter(shape, dtype, parts.device)

    # -- the decision ------------------------------------------------------------------------

    def compresses(self, kind: str, x: torch.Tensor) -> bool:
        """Whether sending ``x`` through ``kind`` from this site is compressed.

        Under the floor: plain, untimed. In auto mode the first call (and a call with a
        message over twice the one timed) decides; timing is a collective call, which every rank
        makes at the same site in the same order. A "compress" verdict covers messages from the
        timed size on (smaller ones were never shown to pay). Without a group to time, each
        message follows the auto mode's size rule (`policy.UNTIMED_BYTES`).
        """
        nbytes = x.numel() * x.element_size()
        settled = self.settled(nbytes, x.dtype)
        return self._decide(kind, nbytes, lambda: x) if settled is None else settled

    def compresses_like(self, kind: str, shape, dtype: torch.dtype, device) -> bool:
        """`compresses` for a message of ``shape`` and ``dtype`` sent in parts (the per-rank
        kinds, a pipeline boundary); a timing, if one is due, runs on zeros of that shape."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        settled = self.settled(nbytes, dtype)
        if settled is None:
            return self._decide(kind, nbytes, lambda: torch.zeros(shape, dtype=dtype, device=device))
        return settled

    def settled(self, nbytes: int, dtype: torch.dtype) -> bool | None:
        """Whether a message of ``nbytes`` in ``dtype`` is compressed by what is settled already:
        the floor (``threshold_bytes``), `call.compresses` (codec settings, bytes, a dtype the
        codec encodes) and an auto decision that covers it; None: an auto decision is due."""
        allowed = nbytes >= self.threshold_bytes and compresses(self._config, nbytes, dtype)
        if not allowed or self.decider is None:
            return allowed
        return None if self.decision is None else self.decision.covers(nbytes)

    def _decide(self, kind: str, nbytes: int, message: Callable[[], torch.Tensor]) -> bool:
        """The auto decision for a message of ``nbytes`` (``message()``: the tensor to time), kept."""
        self.decision = self.decider.decide(self, kind, nbytes, message)
        self.decider.decided()
        return self.decision.covers(nbytes)

    # -- calibration and reports -------------------------------------------------------------

    def observe(self, x: torch.Tensor) -> None:
        """Keep evenly spaced rows of ``x`` (at most ``max_elements`` values) for calibration."""
        if self.samples is None or self.config is None or x.numel() == 0:
            return
        rows = x.detach().reshape(-1, x.shape[-1])
        keep = max(1, min(rows.shape[0], self._max_elements // max(1, rows.shape[1])))
        pick = torch.linspace(0, rows.shape[0] - 1, keep, device=rows.device).long()
        self.samples.append(rows[pick].float())

    def start_recording(self, max_elements: int) -> None:
        self.samples, self._max_elements = [], max_elements

    @property
    def mode(self) -> str:
        """``"auto"``, ``"off"`` (plain) or ``"on"`` (compressed, from ``threshold_bytes`` on)."""
        if self.decider is not None:
            return "auto"
        return "off" if self.config is None else "on"

    def describe(self) -> str:
        """One line: the codec and whether it is used."""
        codec, mode, threshold = describe(self.config), self.mode, self.threshold_bytes
        floor = f", messages from {threshold / 2**20:g} MiB" if threshold and mode != "off" else ""
        if mode == "auto":
            return f"{codec}{floor}, auto: {'undecided' if self.decision is None else self.decision}"
        return codec + floor

    def to_dict(self) -> dict:
        """JSON-ready: mode, codec settings, and the auto decision (``compressed`` None: not yet)."""
        out = {"mode": self.mode, "config": None if self.config is None else self.config.to_dict()}
        if self.decider is not None:
            out["compressed"] = None if self.decision is None else self.decision.compress
            out["decision"] = None if self.decision is None else self.decision.to_dict()
        else:
            out["compressed"] = False if self.config is None else (True if self.threshold_bytes == 0 else None)
        return out

    def __repr__(self) -> str:
        return f"Site({self.name!r}, {self.describe()})"


def describe(config: CodecConfig | None) -> str:
    return "plain" if config is None else f"{config.format} G={config.group_size}"
