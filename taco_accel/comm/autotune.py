"""Does compression pay on this group? Time the plain and the compressed collective on a real
message, and the "auto" decision of a site that follows from it.

    timing = time_collective("all_reduce", x, group, config)   # a collective call: every rank
    timing.compress                                            # the same answer on every rank

TACO only pays when the wire time it saves beats the codec's time, and that depends on the
link, the message size and the GPU: no fixed size threshold is right everywhere. This module
measures instead: after one warm-up call of each (kernels compiled, buffers allocated), it
times ``reps`` calls of the plain collective (input dtype) and of the compressed one, alternating
them, on this very tensor, this group and this backend; each rank takes its median, then one
MAX all-reduce gives every rank the slowest rank's figures, so that all take the same decision
(a collective must not be compressed on one rank and plain on another). Compression is chosen
only when it is faster by more than ``margin`` (default 5%): never slower by default, within
the timing noise.

What to expect per topology (NVSwitch with NCCL's NVLS all-reduce: plain wins; NVLink ring: a
few percent; PCIe or TP across nodes: compression wins) is projected by
`taco_accel.bench.projection`; its table and command are in benchmarks/RESULTS.md. The decision
times each collective alone; a backward all-reduce that `tp.overlap` hides behind the
weight-gradient matmuls costs less than that in the step, while the codec's kernels cannot hide
(they share the GPU). Explicit ``"off"`` for a direction or site pins it.

`AutoDecider` takes the decisions of the auto sites of one table: a site in auto mode starts
undecided; its first call (in the first training step) times the message it actually sends and
keeps the answer as a `Decision`; later calls use it without timing. Sites that send the same
message (the same collective, size, dtype and codec settings, on the same group: e.g. the down
projection of every layer) share one timing. A message more than twice as large as the one timed (a longer
sequence) is timed again. After a "compress" decision, messages at least as large as the timed
one are compressed and smaller ones are not (they were never shown to pay). Without a real group
to time (an emulated model), the auto mode's size rule decides instead: messages from
`policy.UNTIMED_BYTES` on are compressed (a decision with ``rule="size"``). A message under the
site's ``threshold_bytes`` floor is plain and never timed (`site.Site`).

The timing runs the collectives a few extra times (``2 + 2 * reps`` calls) once per distinct
message (kind, size, dtype, settings), during the first steps; warm up in eager mode before
capturing CUDA graphs (a timing syncs the device).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..codec import CodecConfig
from . import agreement, dist_ops, p2p
from .call import Call, propagating_codec
from .copies import SharesGroup
from .kinds import kind_of
from .pieces import PIECE_BYTES
from .policy import UNTIMED_BYTES

logger = logging.getLogger(__name__)

REPS = 3
MARGIN = 0.05


@dataclass(frozen=True)
class Timing:
    """Plain against compressed for one message on one group (seconds: the slowest rank's median)."""

    kind: str
    nbytes: int
    plain_s: float
    compressed_s: float
    compress: bool

    def to_dict(self) -> dict:
        return asdict(self)


def time_collective(
    kind: str, x: torch.Tensor, group, config: CodecConfig, reps: int = REPS, margin: float = MARGIN, *,
    record=None, site: str = "", piece_bytes: int = PIECE_BYTES,
) -> Timing:
    """Time ``kind`` ("all_reduce", "reduce_scatter", "all_gather", or "send": a point-to-point
    message between the two ranks of ``group``, `p2p`) on ``x`` plain and compressed with
    ``config`` in pieces of ``piece_bytes``; a collective call, the same `Timing` on every rank.

    ``record``: the `stats.SiteRecord` of the site that asks, whose first-call agreement check
    (`agreement`) then guards the timed calls too; they record no statistics."""
    x = x.detach().contiguous()
    link = dist_ops.link(group)
    codec = propagating_codec(config.codec)  # no raise during a timing: a non-finite first step is the real call's
    if record is not None and agreement.due(record):
        agreement.check(kind, x.shape, x.dtype, x.device, link, config.codec, True, site or kind, piece_bytes)
    if kind == p2p.KIND:  # the two ranks of a point-to-point link swap the message
        calls = p2p.timed_exchanges(x, link, codec)
    else:
        described = kind_of(kind)
        calls = tuple(lambda on=on: Call(described, x, link, codec if on else None, on, piece_bytes, None,
                                         site or kind).start(x).wait() for on in (False, True))
    for call in calls:  # warm-up: Triton compilation, first allocations, connection set-up
        call()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for call, spent in zip(calls, times):
            spent.append(_seconds(call, x.device))
    medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64, device=x.device)
    if link.world > 1:
        link.all_reduce(medians, "max").wait()
    plain_s, compressed_s = medians.tolist()
    return Timing(kind, x.numel() * x.element_size(), plain_s, compressed_s, compressed_s < plain_s * (1 - margin))


def _seconds(call, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Decision:
    """Plain or compressed for one site, and why.

    ``rule``: ``"timed"`` (this site's message was timed, or ``timed_at`` names the site whose
    identical message was) or ``"size"`` (no group to time: `UNTIMED_BYTES` decided).
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

    def covers(self, nbytes: int) -> bool | None:
        """Whether a message of ``nbytes`` is compressed under this decision, or None when it
        must be decided again: timed, a message over twice the timed one; by size, one on the
        other side of `UNTIMED_BYTES`."""
        if self.rule == "size":
            return self.compress if (nbytes >= UNTIMED_BYTES) == self.compress else None
        if nbytes > 2 * self.nbytes:
            return None
        return self.compress and nbytes >= self.nbytes

    def __str__(self) -> str:
        verdict = "compressed" if self.compress else "plain"
        if self.rule == "size":
            return f"{verdict} (size rule, {self.nbytes / 2**20:.3g} MiB; from {UNTIMED_BYTES / 2**20:g} MiB on)"
        return (f"{verdict} ({self.kind} {self.nbytes / 2**20:.3g} MiB: compressed {self.compressed_us:.0f} us, "
                f"plain {self.plain_us:.0f} us)")


class AutoDecider(SharesGroup):
    """Takes the decisions of the auto sites of one site table (shared timings, logging).

    ``timer`` is the measurement, `time_collective` (a collective call); a test injects another
    (same signature, the same `Timing` on every rank) to take a chosen code path on any machine.
    """

    timer = staticmethod(time_collective)

    def __init__(self, group, timed: bool = True, reps: int = REPS, margin: float = MARGIN) -> None:
        self.group, self.timed, self.reps, self.margin = group, timed, reps, margin
        self.sites: list = []  # the auto sites, for the summary once all are decided
        self._timings: dict[tuple, tuple] = {}  # message key -> (Timing, first site timed)
        self._summarised = False

    def decide(self, site, kind: str, nbytes: int, message: Callable[[], torch.Tensor]) -> Decision:
        """The decision for ``site`` (a `site.Site`) sending a message of ``nbytes`` through
        ``kind``; ``message()`` gives the tensor to time (a collective call when timed)."""
        if not self.timed:
            return Decision(nbytes >= UNTIMED_BYTES, kind, nbytes, "size")
        x = message()
        key = (kind, tuple(x.shape), x.dtype, x.device.type, site.config, site.piece_bytes, site.group)
        if key not in self._timings:  # a link's own timings
            timing = self.timer(kind, x, site.group, site.config, self.reps, self.margin, record=site.record,
                                site=site.name, piece_bytes=site.piece_bytes)
            self._timings[key] = (timing, site.name)
            self._log(logging.INFO, "auto compression: %s %s", site.name, timing_text(timing))
        timing, first = self._timings[key]
        return Decision(timing.compress, kind, nbytes, "timed", timing.plain_s * 1e6, timing.compressed_s * 1e6,
                        None if first == site.name else first)

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
        if dist_ops.group_rank(self.group) == 0:
            logger.log(level, msg, *args)


def timing_text(timing: Timing) -> str:
    verdict = "compress" if timing.compress else "plain"
    return (f"{timing.kind} of {timing.nbytes / 2**20:.3g} MiB: plain {timing.plain_s * 1e3:.3f} ms, "
            f"compressed {timing.compressed_s * 1e3:.3f} ms -> {verdict}")
