"""Cross-entropy over vocab-parallel logits that never gathers the full logits.

Each rank holds the logits of its vocabulary rows. Per token it computes the log-sum-exp of its
part and the target logit if the target is in its rows (0 otherwise); one all-gather of those
two numbers per token gives every rank ``lse = logsumexp_r(lse_r)`` and ``target = sum_r
target_r``, and ``loss = lse - target``. Megatron uses three all-reduces (max, sum of exp,
target) for the same result. Autograd does the backward: each rank gets
``softmax(logits)[own rows] - onehot(target)[own rows]`` with no further communication.
"""

from __future__ import annotations

import torch

from .mappings import gather_from_tp_region
from .sites import Site


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, site: Site, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss (0 where ``target == ignore_index``) from this rank's logits.

    ``logits``: (..., V/tp) this rank's vocabulary rows [vocab_start, vocab_start + V/tp);
    ``target``: (...) ids in the full vocabulary. Computed in fp32. ``site`` must be plain
    (``config=None``): the result is exact up to fp32 rounding.
    """
    parts = local_loss_parts(logits, target, vocab_start, ignore_index)  # (2, ...)
    parts = gather_from_tp_region(parts.unsqueeze(0), site, dim=0)  # (tp, 2, ...)
    return combine_loss_parts(parts, target == ignore_index)


def local_loss_parts(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int = -100) -> torch.Tensor:
    """(2, ...) fp32: the log-sum-exp of this rank's logits (..., V/tp) and the target logit
    where the target is in its rows (0 elsewhere)."""
    logits = logits.float()
    local_vocab = logits.shape[-1]
    local_target = target - vocab_start
    mine = (local_target >= 0) & (local_target < local_vocab) & (target != ignore_index)
    picked = logits.gather(-1, local_target.clamp(0, max(local_vocab - 1, 0)).unsqueeze(-1)).squeeze(-1)
    return torch.stack([torch.logsumexp(logits, dim=-1), picked * mine], dim=0)


def combine_loss_parts(parts: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
    """Per-token loss from every rank's `local_loss_parts` stacked, (tp, 2, ...); 0 where ``ignored``."""
    loss = torch.logsumexp(parts[:, 0], dim=0) - parts[:, 1].sum(dim=0)
    return loss.masked_fill(ignored, 0.0)
