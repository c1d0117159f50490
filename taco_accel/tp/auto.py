"""The "auto" compression mode: each site is compressed only where timing on the real group says it pays.

A site in auto mode starts undecided. Its first call (in the first training step) times the
plain and the compressed collective on the message it actually sends (`comm.autotune`: a
few repetitions, the slowest rank's figures, so every rank decides alike) and keeps the
answer as a `Decision`; later calls use it without timing. Sites that send the same message
(the same collective, size, dtype and codec settings: e.g. the down projection of every layer)
share one timing. A message more than twice as large as the one timed (a longer sequence)
is timed again. After a "compress" decision, messages at least as large as the timed one are
compressed and smaller ones are not (they were never shown to pay).

Without a real group to time (``parallelize(..., emulate=True)``), a site decides by the size
rule of its `TacoConfig` (``threshold_bytes``) instead, and says so in its decision.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from ..comm.autotune import MARGIN, REPS, time_collective
from ..comm.dist_ops import group_rank

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """Plain or compressed for one site, and why.

    ``rule``: ``"timed"`` (this site's message was timed, or ``timed_at`` names the site whose
    identical message was) or ``"size"`` (no group to time: the config's threshold decided).
    """

    compress: bool
    kind: str
    nbytes: int
    rule: str
    plain_us: float | None = None
    compressed_us: float | None = None
    timed_at: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        verdict = "compressed" if self.compress else "plain"
        if self.rule == "size":
            return f"{verdict} (size rule, {self.nbytes / 2**20:.3g} MiB)"
        return (f"{verdict} ({self.kind} {self.nbytes / 2**20:.3g} MiB: compressed {self.compressed_us:.0f} us, "
                f"plain {self.plain_us:.0f} us)")


class AutoDecider:
    """Takes the decisions of the auto sites of one `SiteTable` (shared timings, logging)."""

    def __init__(self, group, timed: bool = True, reps: int = REPS, margin: float = MARGIN) -> None:
        self.group, self.timed, self.reps, self.margin = group, timed, reps, margin
        self.sites: list = []  # the auto sites, for the summary once all are decided
        self._timings: dict[tuple, tuple] = {}  # message key -> (Timing, first site timed)
        self._summarised = False

    def decide(self, site, kind: str, x: torch.Tensor) -> Decision:
        """The decision for ``site`` sending ``x`` through ``kind`` (a collective call when timed)."""
        nbytes = x.numel() * x.element_size()
        if not self.timed:
            decision = Decision(nbytes >= site.config.threshold_bytes and nbytes > 0, kind, nbytes, "size")
        else:
            key = (kind, tuple(x.shape), x.dtype, x.device.type, site.config)
            if key not in self._timings:
                timing = time_collective(kind, x, site.group, site.config, self.reps, self.margin)
                self._timings[key] = (timing, site.name)
                self._log(logging.INFO, "auto compression: %s %s", site.name, timing_text(timing))
            timing, first = self._timings[key]
            decision = Decision(
                timing.compress, kind, nbytes, "timed", timing.plain_s * 1e6, timing.compressed_s * 1e6,
                None if first == site.name else first,
            )
        return decision

    def decided(self) -> None:
        """Called after each decision: one summary line once every auto site has decided."""
        if self._summarised or any(s.decision is None for s in self.sites):
            return
        self._summarised = True
        on = [s for s in self.sites if s.decision.compress]
        per_direction = ", ".join(
            f"{d} {sum(s.name.endswith('/' + d) for s in on)}/{sum(s.name.endswith('/' + d) for s in self.sites)}"
            for d in ("fwd", "bwd")
        )
        self._log(logging.INFO, "auto compression decided: %d of %d sites compressed (%s); "
                  "model.taco.sites.decisions() has the figures", len(on), len(self.sites), per_direction)

    def _log(self, level: int, msg: str, *args) -> None:
        if group_rank(self.group) == 0:
            logger.log(level, msg, *args)


def timing_text(timing) -> str:
    verdict = "compress" if timing.compress else "plain"
    return (f"{timing.kind} of {timing.nbytes / 2**20:.3g} MiB: plain {timing.plain_s * 1e3:.3f} ms, "
            f"compressed {timing.compressed_s * 1e3:.3f} ms -> {verdict}")
