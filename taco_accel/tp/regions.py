"""Where a tensor enters and leaves the tensor-parallel region, with or without sequence parallelism.

Without sequence parallelism the residual stream is replicated: a block enters the TP region
with f (identity forward, all-reduce backward) and leaves it with g (all-reduce forward).
With it (Korthikanti et al. 2022, "Reducing Activation Recomputation") the residual stream is
split between blocks, so norms and dropout work on 1/tp of the tokens: a block enters with an
all-gather (reduce-scatter backward) and leaves with a reduce-scatter (all-gather backward).
It is split once before the first layer and gathered once after the final norm. Each rank
holds one *block* of the (b, s, h) hidden states, shaped (b, s/tp, h): the r-th contiguous
tp-th of its token rows (`mappings`; at batch 1 the r-th part of the sequence), so that no
collective copies to or from another layout.

`SequenceState` is the one piece of per-forward state: whether this forward pass actually
runs on sequence shards. A sequence that does not divide by tp (a one-token decoding step of
``generate``) runs unsplit, which gives the same numbers; that is allowed without gradients
only, because the gradient sums of the replicated norm weights assume the split.
"""

from __future__ import annotations

import torch

from .mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
)
from .sites import Site

SEQ_DIM = 1  # transformers hidden states are (batch, seq, hidden): a block divides dim 1


class SequenceState:
    """Sequence parallelism of one model: configured (``enabled``) and in use this forward (``active``)."""

    def __init__(self, enabled: bool, tp: int) -> None:
        self.enabled, self.tp, self.active = enabled, tp, False

    def begin(self, seq_len: int) -> bool:
        """Called once per forward before the first layer; returns whether to split."""
        self.active = self.enabled and self.tp > 1 and seq_len % self.tp == 0
        if self.enabled and self.tp > 1 and not self.active and torch.is_grad_enabled():
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of tp={self.tp}, which sequence "
                f"parallelism needs for training; pad batches to a multiple of {self.tp} (e.g. "
                f"DataCollatorForLanguageModeling(..., pad_to_multiple_of={self.tp}))"
            )
        return self.active


class RegionEntry:
    """Enter the TP region: f, or the sequence all-gather when sequence parallel this forward.

    ``fwd`` (the all-gather) is only needed with a ``sequence``; ``bwd`` is the gradient's
    all-reduce (or reduce-scatter).
    """

    def __init__(self, fwd: Site | None, bwd: Site, sequence: SequenceState | None = None) -> None:
        self.fwd, self.bwd, self.sequence = fwd, bwd, sequence

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None and self.sequence.active:
            return gather_from_sp_region(x, self.fwd, self.bwd, SEQ_DIM)  # (b, s/tp, h) -> (b, s, h)
        return copy_to_tp_region(x, self.bwd)

    def __repr__(self) -> str:
        return f"RegionEntry({self.bwd.name.rsplit('/', 1)[0]!r})"


class RegionExit:
    """Leave the TP region: g, or the sequence reduce-scatter when sequence parallel this forward.

    This is the reduction step of a row-parallel layer, kept a separate object so that it can
    be replaced (a single-process emulation of tp ranks, LoRA adding its partial product first).
    ``partial`` is the caller's temporary: the all-reduce works in it.
    """

    def __init__(self, fwd: Site, bwd: Site | None = None, sequence: SequenceState | None = None,
                 overlap=None) -> None:
        self.fwd, self.bwd, self.sequence, self.overlap = fwd, bwd, sequence, overlap

    def sequence_overlap(self) -> bool:
        """Whether the row layer should run its product and this reduce-scatter as one
        decomposed step (`overlap.RowSequenceLinear`): sequence parallel now, overlap on."""
        return (self.overlap is not None and self.sequence is not None and self.sequence.active
                and self.overlap.active(self.fwd.group))

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None and self.sequence.active:
            return reduce_scatter_to_sp_region(partial, self.fwd, self.bwd, SEQ_DIM)  # (b, s, h) -> (b, s/tp, h)
        return reduce_from_tp_region(partial, self.fwd, inplace=True)  # the layer's temporary: reduced in place


class HiddenStatesHook:
    """Base of the forward pre-hooks (registered ``with_kwargs=True``) that replace a module's
    ``hidden_states`` input, given as the first positional argument or by keyword: `rewrite`
    returns the tensor the module gets instead, or None to leave the call as it is. Real and
    emulated TP (`taco_accel.tp.emulate`) enter the region and split the sequence this way."""

    def rewrite(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def __call__(self, module, args, kwargs):
        if args:
            hidden = args[0]
        elif "hidden_states" in kwargs:
            hidden = kwargs["hidden_states"]
        else:
            raise TypeError("expected the hidden states as the first argument or as hidden_states=")
        new = self.rewrite(hidden)
        if new is None:
            return None
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}


class SequenceSplit(HiddenStatesHook):
    """Forward pre-hook of the first layer: start the forward's sequence parallelism."""

    def __init__(self, bwd: Site, sequence: SequenceState) -> None:
        self.bwd, self.sequence = bwd, sequence

    def rewrite(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.sequence.begin(hidden.shape[SEQ_DIM]):
            return scatter_to_sp_region(hidden, self.bwd, SEQ_DIM)  # (b, s, h) -> (b, s/tp, h)
        return None


class SequenceGather:
    """Forward hook of the final norm: whole sequence again for the (replicated) lm head."""

    def __init__(self, fwd: Site, sequence: SequenceState) -> None:
        self.fwd, self.sequence = fwd, sequence

    def __call__(self, module, args, output):
        if not self.sequence.active:
            return None
        return gather_from_sp_region(output, self.fwd, None, SEQ_DIM)  # (b, s/tp, h) -> (b, s, h)


class EnterRegionHook(HiddenStatesHook):
    """Forward pre-hook that enters the TP region once for a module's ``hidden_states`` input,
    shared by the column-parallel layers inside it (q/k/v, gate/up): one collective, not three.
    ``entry``: a `RegionEntry`, or an `overlap.ColumnRegion` that also computes those layers."""

    def __init__(self, entry) -> None:
        self.entry = entry

    def rewrite(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.entry(hidden)
