"""Layer 3: Megatron-style tensor parallelism over the compressed collectives of `taco_accel.comm`.

shards (who holds what) -> sites (names and codec settings) -> mappings (autograd functions)
-> regions (entering / leaving the TP region, sequence parallelism) -> layers, cross_entropy;
emulate: the same layers for tp virtual ranks in one process (``parallelize(..., emulate=True)``).
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    sum_replica_grads,
)
from .regions import RegionEntry, RegionExit, SequenceState
from .shards import ShardSpec
from ..comm.policy import Compression, CompressionLike
from .sites import Site, SiteTable

__all__ = [
    "ColumnParallelLinear",
    "Compression",
    "CompressionLike",
    "RegionEntry",
    "RegionExit",
    "RowParallelLinear",
    "SequenceState",
    "ShardSpec",
    "Site",
    "SiteTable",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_sp_region",
    "sum_replica_grads",
    "vocab_parallel_cross_entropy",
]
