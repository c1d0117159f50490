"""The causal-LM head of a parallelised model: vocab-parallel loss, full logits only when wanted.

transformers' causal LMs compute ``logits = lm_head(hidden)`` and then
``loss = self.loss_function(logits, labels, vocab_size, ...)``. `parallelize` installs two
small pieces around that code, which it does not change:

- `LogitsMode`, a forward pre-hook on the model: with ``labels`` (training) the lm head
  returns this rank's vocabulary slice of the logits, (b, s, V/tp); without them (inference,
  ``generate``) it gathers the full (b, s, V) logits. ``model.taco.logits = "full"`` or
  ``"local"`` forces one of the two.
- `CausalLMLoss` as ``model.loss_function``: on a vocabulary slice it runs
  `vocab_parallel_cross_entropy`; on full logits it defers to transformers' loss. Labels
  outside the vocabulary (other than ``ignore_index``) raise an IndexError on every rank,
  as ``F.cross_entropy`` does (`checks.check_labels`).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..tp.cross_entropy import vocab_parallel_cross_entropy
from ..tp.sites import Site
from .checks import check_labels

LOGITS_MODES = ("auto", "full", "local")


class CausalLMLoss:
    """transformers' ``ForCausalLMLoss`` (shift, ignore_index, num_items_in_batch) on
    vocab-parallel logits."""

    def __init__(self, lm_head: nn.Module, site: Site, fallback=None) -> None:
        if fallback is None:
            from transformers.loss.loss_utils import ForCausalLMLoss as fallback
        self.lm_head, self.site, self.fallback = lm_head, site, fallback

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
        ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs,
    ) -> torch.Tensor:
        if self.full_logits(logits, vocab_size):  # gathered, or tp=1
            return self.fallback(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
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

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> bool:
        """Whether ``logits`` hold the whole vocabulary (then transformers' loss applies)."""
        return logits.shape[-1] == vocab_size

    def token_losses(self, logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Per-token loss (0 where ignored) from this rank's vocabulary slice of the logits."""
        vocab_start = self.lm_head.shard.ranges[self.lm_head.rank][0][0]
        return vocab_parallel_cross_entropy(logits, shift_labels, vocab_start, self.site, ignore_index)


class LogitsMode:
    """Forward pre-hook on the causal LM: should the lm head gather the full logits?"""

    def __init__(self, model: nn.Module, lm_head: nn.Module, context) -> None:
        self.lm_head, self.context = lm_head, context
        params = [
            p.name for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.labels_index = params.index("labels") if "labels" in params else None

    def __call__(self, module, args, kwargs):
        mode = self.context.logits
        if mode not in LOGITS_MODES:
            raise ValueError(f"model.taco.logits={mode!r}; use one of {LOGITS_MODES}")
        labels = kwargs.get("labels")
        if labels is None and self.labels_index is not None and len(args) > self.labels_index:
            labels = args[self.labels_index]
        self.lm_head.gather_output = mode == "full" or (mode == "auto" and labels is None)
