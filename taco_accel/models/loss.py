"""The causal-LM head of a parallelised model: full logits out, vocab-parallel loss inside.

transformers' causal LMs compute ``logits = lm_head(hidden)`` and then
``loss = self.loss_function(logits, labels, vocab_size, ...)``, and return both. `parallelize`
installs three small pieces around that code, which it does not change:

- `LogitsGather`, a forward hook on the lm head: it all-gathers this rank's vocabulary slice
  (b, s, V/tp) into the full logits (b, s, V), transformers' convention, whenever a user can
  see them. The gather is differentiable (forward: all-gather, backward: keep this rank's
  slice; `ColumnParallelLinear.gather_outputs`), so a loss computed from ``outputs.logits``
  trains right: every TP rank computes the same loss from the same full logits.
- `CausalLMLoss` as ``model.loss_function``: the vocab-parallel cross-entropy on this rank's
  slice, never on the gathered tensor (the slice the head computed is kept beside the full
  logits, so the loss's backward does not run through the gather). Labels outside the
  vocabulary (other than ``ignore_index``) raise an IndexError on every rank, as
  ``F.cross_entropy`` does (`checks.check_labels`).
- `LogitsModeHook`, a forward pre-hook on the model: it tells the head whether this forward has
  ``labels`` (for ``logits="local"``) and validates the mode.

``logits`` (`LogitsMode`, ``model.taco.logits``, `parallelize`'s and the Accelerator's
``logits=``): ``"full"`` (default) returns the full logits always; ``"local"`` saves the
all-gather and the (b, s, V) tensor when ``labels`` are given: ``outputs.logits`` is then this
rank's vocabulary slice (b, s, V/tp) and only ``outputs.loss`` is meaningful as a whole (the
project's Trainer and Finetuner use it); without labels (generation, evaluation from logits)
the logits are full in both modes. Pipeline stages call the head directly: the last stage
returns full logits under ``"full"`` (a custom ``loss_fn`` sees what a user would) and this
rank's slice under ``"local"``. An emulated model (``emulate=True``) holds every rank in one
process: its logits are full in both modes.
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..tp.cross_entropy import vocab_parallel_cross_entropy
from ..tp.sites import Site
from .checks import check_labels

LogitsMode = Literal["full", "local"]
LOGITS_MODES: tuple[str, ...] = ("full", "local")


def check_logits_mode(mode) -> str:
    """``mode`` itself when it is one of `LOGITS_MODES`; a TypeError / ValueError naming them otherwise."""
    if not isinstance(mode, str):
        raise TypeError(f"logits={mode!r} must be a str, one of {LOGITS_MODES}")
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits={mode!r}: use one of {LOGITS_MODES} ('full': transformers' full-vocabulary "
                         "logits, the default; 'local': this rank's vocabulary slice when labels are given)")
    return mode


class LogitsGather:
    """Forward hook on the lm head (a `ColumnParallelLinear`) of real TP: the full logits.

    Keeps ``(full, local)`` of its last gather until the loss takes the local slice
    (`local_part`) or the model's next forward starts (`LogitsModeHook` clears it).
    """

    def __init__(self, context) -> None:
        self.context = context
        self.labels: bool | None = None  # this forward has labels; None: unknown (a pipeline stage)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, head: nn.Module, args, local: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None
        self.kept = None
        if self.context.logits == "local" and labels is not False:
            return local  # (b, s, V/tp): the loss follows
        full = head.gather_outputs(local)  # (b, s, V), rank order
        self.kept = (full, local)
        return full

    def local_part(self, head: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of ``logits``: the head's own local output when ``logits``
        is its last gathered output, a slice of other full logits, or ``logits`` if already local."""
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] is logits:
            return kept[1]
        if logits.shape[-1] != head.out_features:
            return logits
        ((start, stop),) = head.shard.ranges[head.rank]
        return logits.narrow(-1, start, stop - start)  # its backward: zeros but for this rank's slice


class CausalLMLoss:
    """transformers' ``ForCausalLMLoss`` (shift, ignore_index, num_items_in_batch) computed on
    this rank's vocabulary slice (`vocab_parallel_cross_entropy`); transformers' own at tp=1."""

    def __init__(self, lm_head: nn.Module, site: Site, fallback=None, gather: LogitsGather | None = None) -> None:
        if fallback is None:
            from transformers.loss.loss_utils import ForCausalLMLoss as fallback
        self.lm_head, self.site, self.fallback, self.gather = lm_head, site, fallback, gather

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
        ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs,
    ) -> torch.Tensor:
        if self.lm_head.tp == 1:
            return self.fallback(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        logits = self.loss_input(logits)
        if shift_labels is None:  # tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        check_labels(shift_labels, logits, vocab_size, ignore_index)  # a label with no row raises
        loss = self.token_losses(logits, shift_labels, ignore_index)
        if num_items_in_batch is None:
            return loss.sum() / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss.sum() / num_items_in_batch

    def loss_input(self, logits: torch.Tensor) -> torch.Tensor:
        """What `token_losses` reads: this rank's vocabulary slice (b, s, V/tp)."""
        if self.gather is None:
            return logits
        return self.gather.local_part(self.lm_head, logits)

    def token_losses(self, logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Per-token loss (0 where ignored) from this rank's vocabulary slice of the logits."""
        vocab_start = self.lm_head.shard.ranges[self.lm_head.rank][0][0]
        return vocab_parallel_cross_entropy(logits, shift_labels, vocab_start, self.site, ignore_index)


class LogitsModeHook:
    """Forward pre-hook on the causal LM: validates ``context.logits`` and tells ``gather``
    whether this forward has ``labels``."""

    def __init__(self, model: nn.Module, gather: LogitsGather, context) -> None:
        self.gather, self.context = gather, context
        params = [
            p.name for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.labels_index = params.index("labels") if "labels" in params else None

    def __call__(self, module, args, kwargs):
        check_logits_mode(self.context.logits)
        labels = kwargs.get("labels")
        if labels is None and self.labels_index is not None and len(args) > self.labels_index:
            labels = args[self.labels_index]
        self.gather.kept = None
        self.gather.labels = labels is not None
