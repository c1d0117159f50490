"""Per call-site statistics of the collectives: calls, bytes on the wire, sampled error.

Every collective records, under its ``site`` name, the bytes this rank actually sent and the
bytes the plain collective in the input dtype would have sent (bandwidth-optimal ring
figures, per rank; see `plain_bytes`). Recording is Python integer arithmetic on shapes: no
device work, no host sync. `pop_comm_stats` returns the figures and starts afresh.

Error sampling is off by default. ``set_error_sampling(N)`` makes every N-th *compressed*
call of each site also run the plain collective in float64 and keep
``||compressed - exact|| / ||exact||`` as a device tensor; it is read (one sync) only by
`pop_comm_stats`. The sampled call costs one extra collective, so every rank of a group must
use the same N: the per-site counter that picks the sampled calls is never reset by
`pop_comm_stats` (a trainer that pops on rank 0 only keeps the ranks in step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CommStats:
    """Figures of one call site since the last `pop_comm_stats` (bytes are per rank)."""

    calls: int = 0
    compressed_calls: int = 0
    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    error_samples: int = 0
    error_mean: float | None = None
    error_max: float | None = None

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes over bytes sent (1.0 when nothing was sent)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    def to_dict(self) -> dict:
        """Plain values for a logger (compression_ratio included)."""
        return {**dataclasses.asdict(self), "compression_ratio": self.compression_ratio}


@dataclass
class _Accumulator:
    calls: int = 0
    compressed_calls: int = 0
    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    errors: list = field(default_factory=list)  # 0-d float tensors, possibly on a device

    def freeze(self) -> CommStats:
        values = [float(e) for e in self.errors]  # the only host sync, off the hot path
        return CommStats(
            self.calls, self.compressed_calls, self.bytes_sent, self.bytes_uncompressed,
            len(values),
            sum(values) / len(values) if values else None,
            max(values) if values else None,
        )


_sites: dict[str, _Accumulator] = {}
_ticks: dict[str, int] = {}  # compressed calls per site; never reset by pop_comm_stats
_sample_every = 0


def set_error_sampling(every: int) -> None:
    """Sample the relative error on every ``every``-th compressed call of each site (0: off).

    Call it with the same value on every rank, before the calls it should affect.
    """
    global _sample_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"set_error_sampling(every={every!r}): use an int >= 0 (0 turns sampling off)")
    _sample_every = every
    _ticks.clear()


def error_sampling() -> int:
    """The current ``every`` of `set_error_sampling` (0: off)."""
    return _sample_every


def record(site: str, *, sent: int, uncompressed: int, compressed: bool) -> None:
    """Count one call of ``site`` that sent ``sent`` bytes (the plain collective: ``uncompressed``)."""
    acc = _sites.get(site)
    if acc is None:
        acc = _sites[site] = _Accumulator()
    acc.calls += 1
    acc.compressed_calls += int(compressed)
    acc.bytes_sent += sent
    acc.bytes_uncompressed += uncompressed


def should_sample(site: str) -> bool:
    """Advance the compressed-call counter of ``site``; True on the calls to sample."""
    if not _sample_every:
        return False
    tick = _ticks.get(site, 0) + 1
    _ticks[site] = tick
    return tick % _sample_every == 0


def record_error(site: str, error: torch.Tensor) -> None:
    """Keep one sampled relative error (a 0-d tensor; read later, not now)."""
    _sites.setdefault(site, _Accumulator()).errors.append(error.detach())


def pop_comm_stats() -> dict[str, CommStats]:
    """The figures of every site since the last call, keyed by site name; then reset them."""
    out = {site: acc.freeze() for site, acc in _sites.items()}
    _sites.clear()
    return out


def plain_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) plain collective.

    ``nbytes`` is the size of the input of this rank: all_reduce 2(P-1)/P * nbytes,
    reduce_scatter (P-1)/P * nbytes (the input holds P blocks), all_gather (P-1) * nbytes.
    """
    if kind == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    if kind == "reduce_scatter":
        return (world - 1) * nbytes // world
    if kind == "all_gather":
        return (world - 1) * nbytes
    raise ValueError(f"unknown collective {kind!r}")
