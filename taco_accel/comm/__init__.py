"""Layer 2: compressed collectives over torch.distributed (NCCL on GPU, gloo on CPU)."""

from .collectives import all_gather, all_reduce, reduce_scatter

__all__ = ["all_gather", "all_reduce", "reduce_scatter"]
