"""Layer 2: compressed collectives over torch.distributed (NCCL on GPU, gloo on CPU).

    all_reduce(x, group=None, config=None, *, site=None, inplace=False)   # sum over the group's ranks
    reduce_scatter(x, group=None, config=None, *, site=None)              # this rank's rows of the sum
    all_gather(x, group=None, config=None, *, site=None)                  # concatenation along dim 0

``config=None`` is the plain collective in the input dtype; with a `TacoConfig` a message takes
the TACO FP8 path, in pieces of ``piece_bytes`` (``compress=False`` keeps it plain): these are
the codec-level escape hatch, with no policy; `Compression` (`policy`: modes, size floor, piece
size) applies through sites. Every collective call is a `Call` (``async_op=True`` returns it in
flight: ``progress()``, ``wait()``). A `Site` is a named call point with its own settings,
decision (its `Compression`'s floor, or the timed auto mode of `autotune`) and statistics in a
`Ledger`; layer 3 keeps one per TP collective, in one ledger per model. `pop_comm_stats` returns
and resets the per-site figures of the process (bytes sent against the plain collective, calls,
sampled error); `set_error_sampling` turns the error sampling on. `EmulatedGroup` runs the same
collectives for P virtual ranks in one process (lists of per-rank tensors in, the same bytes
out), for emulated TP. ``site.gather_by_rank`` / ``site.scatter_by_rank``: all_gather and
reduce_scatter cut per rank (the per-rank kinds, for compute overlap). Also: `ops` (custom ops
for torch.compile).
"""

from ..errors import CollectiveMismatch, CollectiveTimeout
from .call import Call
from .collectives import all_gather, all_reduce, reduce_scatter
from .emulated import EmulatedGroup
from .pieces import PIECE_BYTES
from .policy import DEFAULT_MODE, Compression, CompressionLike
from .site import Site
from .stats import CommStats, Ledger, pop_comm_stats, set_error_sampling

__all__ = [
    "PIECE_BYTES",
    "Call",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommStats",
    "Compression",
    "CompressionLike",
    "DEFAULT_MODE",
    "EmulatedGroup",
    "Ledger",
    "Site",
    "all_gather",
    "all_reduce",
    "pop_comm_stats",
    "reduce_scatter",
    "set_error_sampling",
]
