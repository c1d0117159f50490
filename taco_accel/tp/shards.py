"""Who holds what: `ShardSpec`, the blocks of a full tensor each TP rank keeps, and
`linear_layout`, the layout of the transformers linears they split.

A `ShardSpec` speaks in the layout of the *full* transformers tensor (``nn.Linear`` weights are
[out, in], GPT-2 ``Conv1D`` weights are [in, out]), so the same object slices a checkpoint,
reassembles a full state dict and checks a gradient against the single-process model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

Ranges = tuple[tuple[int, int], ...]  # [start, stop) blocks along one dim, concatenated in order


class LinearLayout(NamedTuple):
    in_features: int
    out_features: int
    conv1d: bool  # weight [in, out] (transformers Conv1D) instead of nn.Linear's [out, in]


def linear_layout(module: nn.Module) -> LinearLayout:
    """The features and weight layout of an ``nn.Linear`` or a transformers ``Conv1D``, the
    modules a TP plan splits (real and emulated layers, and the shards computed for them)."""
    if isinstance(module, nn.Linear):
        return LinearLayout(module.in_features, module.out_features, False)
    if type(module).__name__ == "Conv1D":  # weight [in, out]; avoid importing transformers here
        return LinearLayout(module.weight.shape[0], module.weight.shape[1], True)
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


def divide(numerator: int, tp: int, what: str) -> int:
    """``numerator / tp``, or a ValueError that names the quantity and the valid tp degrees."""
    if numerator % tp:
        valid = [d for d in range(1, numerator + 1) if numerator % d == 0]
        raise ValueError(f"tp={tp} does not divide {what}={numerator}; use a tp degree in {valid}")
    return numerator // tp


@dataclass(frozen=True)
class ShardSpec:
    """How one tensor is split over the ``tp`` ranks of a group along ``dim``.

    ``ranges[r]`` lists the [start, stop) blocks of the full tensor that rank r holds, in the
    order they are concatenated locally (one block for a plain split, three for GPT-2's fused
    q|k|v). Several ranks may hold the same block (grouped-query attention with fewer kv heads
    than ranks): their gradients must then be summed, see `replicas`.
    """

    dim: int
    full_size: int
    ranges: tuple[Ranges, ...]

    @property
    def tp(self) -> int:
        return len(self.ranges)

    @functools.cached_property  # read in every emulated backward: computed once per spec
    def replicas(self) -> int:
        """How many ranks hold each block (1 unless kv heads are replicated)."""
        return sum(1 for r in self.ranges if r == self.ranges[0])

    @functools.cached_property
    def in_order(self) -> bool:
        """Whether each rank holds one block and the blocks follow each other in rank order over
        the whole tensor: the full tensor is then the concatenation of the parts."""
        blocks = [r[0] for r in self.ranges if len(r) == 1]
        return (len(blocks) == self.tp and blocks[0][0] == 0 and blocks[-1][1] == self.full_size
                and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:])))

    def size(self, rank: int) -> int:
        return sum(stop - start for start, stop in self.ranges[rank])

    def take(self, full: torch.Tensor, rank: int, copy: bool = True) -> torch.Tensor:
        """Rank ``rank``'s part of ``full``, contiguous: a new tensor, so that ``full`` can be
        freed (``copy=False``: a view where the part is one contiguous block)."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got {list(full.shape)}")
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.ranges[rank]]
        if len(parts) > 1:
            return torch.cat(parts, dim=self.dim)
        return parts[0].clone() if copy else parts[0].contiguous()

    def index(self, rank: int) -> list[tuple]:
        """Per block of rank ``rank``, the index that cuts it out of the full tensor
        (``full[idx]``, also valid on a safetensors slice)."""
        lead = (slice(None),) * self.dim
        return [(*lead, slice(start, stop)) for start, stop in self.ranges[rank]]

    def assemble(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's local part (``pieces[r]`` from rank r)."""
        if self.in_order:
            return torch.cat(list(pieces), dim=self.dim)
        shape = list(pieces[0].shape)
        shape[self.dim] = self.full_size
        full = pieces[0].new_empty(shape)
        for rank, piece in enumerate(pieces):
            self.place(piece, rank, full)
        return full

    def place(self, piece: torch.Tensor, rank: int, full: torch.Tensor, accumulate: bool = False) -> None:
        """Write (``accumulate``: add) rank ``rank``'s local part ``piece`` into its blocks of ``full``."""
        offset = 0
        for start, stop in self.ranges[rank]:
            block, src = full.narrow(self.dim, start, stop - start), piece.narrow(self.dim, offset, stop - start)
            block.add_(src) if accumulate else block.copy_(src)
            offset += stop - start

    def on_dim(self, dim: int) -> "ShardSpec":
        """The same split along another dim (a bias shares its weight's output split)."""
        return ShardSpec(dim, self.full_size, self.ranges)

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def even(cls, full_size: int, tp: int, dim: int = 0, what: str = "the size") -> "ShardSpec":
        """Equal contiguous blocks; ``tp`` must divide ``full_size``."""
        n = divide(full_size, tp, what)
        return cls(dim, full_size, tuple(((r * n, (r + 1) * n),) for r in range(tp)))

    @classmethod
    def balanced(cls, full_size: int, tp: int, dim: int = 0) -> "ShardSpec":
        """Contiguous blocks whose sizes differ by at most one (a vocabulary of any size)."""
        base, extra = divmod(full_size, tp)
        starts = [r * base + min(r, extra) for r in range(tp + 1)]
        return cls(dim, full_size, tuple(((starts[r], starts[r + 1]),) for r in range(tp)))

    @classmethod
    def heads(cls, num_heads: int, head_dim: int, tp: int, dim: int = 0, what: str = "num_heads") -> "ShardSpec":
        """Whole heads per rank. Fewer heads than ranks: each head is replicated on
        ``tp / num_heads`` consecutive ranks (Megatron's answer for kv heads of GQA)."""
        if num_heads % tp == 0:
            return cls.even(num_heads, tp, what=what).scaled(head_dim, dim)
        if tp % num_heads == 0:
            per = tp // num_heads
            ranges = tuple(((r // per * head_dim, (r // per + 1) * head_dim),) for r in range(tp))
            return cls(dim, num_heads * head_dim, ranges)
        raise ValueError(
            f"tp={tp} and {what}={num_heads}: one must divide the other (shard the heads, or "
            f"replicate each head on tp/{what} ranks); use a tp degree that divides {num_heads} or "
            f"a multiple of it"
        )

    def scaled(self, factor: int, dim: int | None = None) -> "ShardSpec":
        """Every block scaled by ``factor`` (heads -> features)."""
        ranges = tuple(tuple((a * factor, b * factor) for a, b in rr) for rr in self.ranges)
        return ShardSpec(self.dim if dim is None else dim, self.full_size * factor, ranges)

    @classmethod
    def concat(cls, specs: Sequence["ShardSpec"]) -> "ShardSpec":
        """Specs of blocks that sit one after another in one fused tensor (GPT-2's q|k|v)."""
        ranges, offset = [[] for _ in range(specs[0].tp)], 0
        for spec in specs:
            for rank, rr in enumerate(spec.ranges):
                ranges[rank].extend((a + offset, b + offset) for a, b in rr)
            offset += spec.full_size
        return cls(specs[0].dim, offset, tuple(tuple(r) for r in ranges))
