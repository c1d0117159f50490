"""Layer 2: compressed collectives over torch.distributed (NCCL on GPU, gloo on CPU).

    all_reduce(x, group=None, config=None, *, site=None)      # sum over the group's ranks
    reduce_scatter(x, group=None, config=None, *, site=None)  # this rank's rows of the sum
    all_gather(x, group=None, config=None, *, site=None)      # concatenation along dim 0

``config=None`` (or a message under ``config.threshold_bytes``) is the plain collective in the
input dtype; otherwise the TACO FP8 path, in pieces of ``config.piece_bytes`` (`PIECE_BYTES`
is the measured default that layer 3 uses). ``async_op=True`` returns a `Pending`
(``progress()``, ``wait()``). `pop_comm_stats` returns and resets the per-site figures (bytes
sent against the plain collective, calls, sampled error); `set_error_sampling` turns the error
sampling on. `EmulatedGroup` runs the same collectives for P virtual ranks in one process
(lists of per-rank tensors in, the same bytes out), for emulated TP. Also: `autotune` (plain
against compressed on a real message), `chunked` (the collectives cut per rank, for compute
overlap), `ops` (custom ops for torch.compile), `release_workspaces` (the reused receive buffers).
"""

from .agreement import CollectiveMismatch, CollectiveTimeout
from .collectives import Pending, all_gather, all_reduce, reduce_scatter
from .compressed import release_workspaces
from .emulated import EmulatedGroup
from .pieces import PIECE_BYTES
from .stats import CommStats, error_sampling, pop_comm_stats, set_error_sampling

__all__ = [
    "PIECE_BYTES",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommStats",
    "EmulatedGroup",
    "Pending",
    "all_gather",
    "all_reduce",
    "error_sampling",
    "pop_comm_stats",
    "reduce_scatter",
    "release_workspaces",
    "set_error_sampling",
]
