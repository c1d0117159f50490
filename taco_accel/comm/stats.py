"""Per call-site statistics of the collectives, and the `Ledger` that owns them.

A `Ledger` holds one `SiteRecord` per site name: the calls, bytes on the wire and sampled errors
since the last pop, the site's compressed-call counter of the error sampling and its agreement
checks (`agreement`). Each parallelised model's `SiteTable` has its own ledger, so two models
in one process keep separate counts and check their own first calls; collectives called with a
site *name* (`all_reduce(x, group, config, site="...")`) record into the process's ``DEFAULT``
ledger.

Every collective records the bytes this rank actually sent and the bytes the plain collective
in the input dtype would have sent (`ring_bytes`: the bandwidth-optimal ring figures, per rank).
Recording is Python integer arithmetic on shapes: no device work, no host sync.

`pop_comm_stats` returns the figures of every site in this process (the ``DEFAULT`` ledger and
every live model's, added up where two ledgers hold a site of the same name) and starts them
afresh; ``Ledger.pop`` does that for one ledger (``model.taco.sites.pop_stats()``).

Each record also keeps the device-side comparisons of the wire headers its site received
(`codec.api.compare_headers`; on a GPU, or on the CPU with ``TACO_DEFER_HEADER_READS=1``): a pop
reads those written since their last read and raises a `WireFormatError` naming the site; a
training step reads them earlier, once per optimizer step, in a host read it makes anyway
(`WireCheck`: taken for every site of a model, its flag folded into that read, then settled).

Error sampling is off by default. ``set_error_sampling(N)`` makes every N-th *compressed*
call of each site also run the plain collective in float64 and keep
``||compressed - exact|| / ||exact||`` as a device tensor; it is read (one sync) only when the
figures are popped. The sampled call costs one extra collective, so every rank of a group must
use the same N: the per-site counter that picks the sampled calls is never reset by a pop (a
trainer that pops on rank 0 only keeps the ranks in step).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass

import torch

from ..codec.api import SIZES_DIFFER, HeaderFlags, any_mismatch, mismatch_flag, raise_mismatches, settle_flags
from ..errors import WireFormatError


def ring_bytes(kind, nbytes: int, world: int) -> int:
    """The bytes one rank sends in the bandwidth-optimal (ring) plain collective of ``kind`` (a
    `kinds.Kind`) on an input of ``nbytes``: P-1 blocks of the reduced or gathered tensor, twice
    for an all-reduce (a reduce-scatter, then an all-gather)."""
    if not kind.reduces:
        return (world - 1) * nbytes  # the input is one rank's block of the gathered tensor
    return (1 if kind.scatters else 2) * (world - 1) * nbytes // world  # the input holds P blocks


@dataclass(frozen=True)
class CommStats:
    """Figures of one call site since the last pop (bytes are per rank)."""

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

    def __add__(self, other: "CommStats") -> "CommStats":
        """The figures of two sites of one name (two models), added up."""
        samples = self.error_samples + other.error_samples
        means = [(s.error_mean, s.error_samples) for s in (self, other) if s.error_samples]
        maxes = [s.error_max for s in (self, other) if s.error_samples]
        return CommStats(
            self.calls + other.calls, self.compressed_calls + other.compressed_calls,
            self.bytes_sent + other.bytes_sent, self.bytes_uncompressed + other.bytes_uncompressed,
            samples, sum(m * n for m, n in means) / samples if samples else None, max(maxes) if maxes else None,
        )


class SiteRecord:
    """What a `Ledger` keeps about one site: figures since the last pop, the compressed-call
    counter of the error sampling (``ticks``), the agreement checks made (``checked``) and the
    device-side comparisons of the chunk headers it received (``header_flags``:
    `codec.api.compare_headers`, read when the figures are popped)."""

    __slots__ = ("calls", "compressed_calls", "bytes_sent", "bytes_uncompressed", "errors", "ticks", "checked",
                 "generation", "header_flags")

    def __init__(self) -> None:
        self.calls = self.compressed_calls = self.bytes_sent = self.bytes_uncompressed = 0
        self.errors: list[torch.Tensor] = []  # 0-d float tensors, possibly on a device
        self.ticks = self.checked = 0
        self.header_flags = HeaderFlags()  # `codec.api.compare_headers`'s, read at the next host sync
        self.generation = _sampling.generation

    def add(self, sent: int, uncompressed: int, compressed: bool) -> None:
        """Count one call that sent ``sent`` bytes (the plain collective: ``uncompressed``)."""
        self.calls += 1
        self.compressed_calls += compressed
        self.bytes_sent += sent
        self.bytes_uncompressed += uncompressed

    def sample_due(self) -> bool:
        """Advance the compressed-call counter; True on the calls whose error is sampled."""
        every = _sampling.every
        if not every:
            return False
        if self.generation != _sampling.generation:  # set_error_sampling since: count afresh
            self.generation, self.ticks = _sampling.generation, 0
        self.ticks += 1
        return self.ticks % every == 0

    def pop(self) -> CommStats:
        """The figures since the last pop; then zero them (the counters stay)."""
        values = [float(e) for e in self.errors]  # the only host sync, off the hot path
        out = CommStats(
            self.calls, self.compressed_calls, self.bytes_sent, self.bytes_uncompressed, len(values),
            sum(values) / len(values) if values else None, max(values) if values else None,
        )
        self.calls = self.compressed_calls = self.bytes_sent = self.bytes_uncompressed = 0
        self.errors = []
        return out


class Ledger:
    """The `SiteRecord` of every site of one model (or of the process: ``DEFAULT``), by name.

    Every ledger is registered for `pop_comm_stats`, a copy too (``copy.deepcopy`` of a model:
    its sites keep recording in the copied records)."""

    def __init__(self) -> None:
        self._records: dict[str, SiteRecord] = {}
        _ledgers.add(self)

    def __deepcopy__(self, memo: dict) -> "Ledger":
        copied = memo[id(self)] = Ledger()
        copied._records = copy.deepcopy(self._records, memo)
        return copied

    def record(self, site: str) -> SiteRecord:
        """The record of ``site``, created on first use (a site keeps it for its lifetime)."""
        found = self._records.get(site)
        if found is None:
            found = self._records[site] = SiteRecord()
        return found

    def pop(self, check: bool = True) -> dict[str, CommStats]:
        """The figures of every site that was called since the last pop, by name; then zero them.
        ``check``: a `WireFormatError` naming the site if a chunk it received since the last read
        of its header flags had another header (one host read for every site's flags, none when
        none was compared since). ``check=False`` leaves them to a `WireCheck`."""
        if check:
            flagged = self.header_flags()
            if any_mismatch([flags for _, flags in flagged]):
                for name, flags in flagged:
                    raise_mismatches(flags, name)
        return {name: rec.pop() for name, rec in self._records.items() if rec.calls or rec.errors}

    def header_flags(self) -> list[tuple[str, HeaderFlags]]:
        """``(site, its HeaderFlags)`` of every site that has compared a received header."""
        return [(name, record.header_flags) for name, record in self._records.items() if record.header_flags]

    def __repr__(self) -> str:
        return f"Ledger({len(self._records)} sites)"


class WireCheck:
    """The header flags of the sites of some ledgers (a model's) compared since their last read, as
    one device flag, for a caller to read along with values it reads anyway (or to sum over ranks
    in a collective it makes anyway), then `settle` with what it read: no host read of its own.

    ``flag``: a 0-d float32 tensor on ``device``, 1.0 where a chunk that one of the sites received
    had another header (its values read as NaN), else 0.0. What the training steps use to raise
    such an error at the optimizer step that would use the values (`taco_accel.Accelerator`)."""

    __slots__ = ("named", "flag", "_marks")

    def __init__(self, ledgers, device) -> None:
        self.named = [named for ledger in ledgers for named in ledger.header_flags()]
        self.flag, self._marks = mismatch_flag([flags for _, flags in self.named], device)

    @property
    def empty(self) -> bool:
        """Whether no site compared a header since the last read (``flag`` is 0 then)."""
        return not self._marks.rings

    def settle(self, found: bool) -> None:
        """After the caller read ``flag`` (or its sum over ranks: ``found``, whether it was set): a
        `WireFormatError` naming this rank's first site with such a chunk (reading each site's
        flags: the error path), or saying a peer's site had one; else the flags are marked read."""
        settle_flags(self._marks, found)
        if not found:
            return
        for name, flags in self.named:
            raise_mismatches(flags, name)
        raise WireFormatError(
            "a chunk that another rank received in this step's collectives did not carry its header (another "
            f"TacoConfig, or a message of another length or sign_seed; its values were read as NaN), and that rank's "
            f"error names the site: {SIZES_DIFFER}"
        )


class _Sampling:
    every = 0
    generation = 0


_sampling = _Sampling()
_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()
DEFAULT = Ledger()


def set_error_sampling(every: int) -> None:
    """Sample the relative error on every ``every``-th compressed call of each site (0: off).

    Call it with the same value on every rank, before the calls it should affect; the sites'
    counters start afresh.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"set_error_sampling(every={every!r}): use an int >= 0 (0 turns sampling off)")
    _sampling.every = every
    _sampling.generation += 1


def pop_ledgers(ledgers, check: bool = True) -> dict[str, CommStats]:
    """The figures of the sites of ``ledgers`` (one model's) since their last pop, keyed by site
    name (added up where two ledgers hold a site of one name), then reset: what one model's
    consumers read (`taco_accel.Accelerator.compression_stats`, the training loops), leaving
    every other model's figures alone. ``check``: `Ledger.pop`'s."""
    out: dict[str, CommStats] = {}
    for ledger in ledgers:
        for name, figures in ledger.pop(check).items():
            out[name] = out[name] + figures if name in out else figures
    return out


def pop_comm_stats() -> dict[str, CommStats]:
    """The figures of every site in this process since the last pop, keyed by site name, then
    reset: the direct calls' (``DEFAULT``) and every live model's, added up where two models
    have a site of the same name. A process-wide view for scripts and benchmarks: a consumer of
    one model's figures reads that model's ledgers (`pop_ledgers`; ``model.taco.sites.pop_stats()``),
    so that two models in a process (a policy and its reference) keep separate counts."""
    return pop_ledgers([DEFAULT, *(ledger for ledger in list(_ledgers) if ledger is not DEFAULT)])
