"""The vocab-parallel cross-entropy: its chunk kernels, and the loss over logits that never gathers them.

Each rank holds the logits of its vocabulary rows. Per token it computes the log-sum-exp of its
part and the target logit if the target is in its rows (0 otherwise): `local_loss_parts`. One
all-gather of those two numbers per token gives every rank ``lse = logsumexp_r(lse_r)`` and
``target = sum_r target_r``, and ``loss = lse - target`` (`combine_loss_parts`). Megatron uses
three all-reduces (max, sum of exp, target) for the same result. The gradient needs no further
communication: each rank's slice of ``d loss / d logits`` is ``softmax(logits)[own rows] -
onehot(target)[own rows]``, taken against the global ``lse`` (`softmax_grad`, the one softmax
gradient of the package: the fused head and loss, the per-token log-probabilities of TRL's fused
head and this module's loss over logits all call it).

The kernels are pure functions of one chunk of tokens (no chunk size, no Python state), so
``torch.compile`` fuses each into a few kernels that read the chunk's logits once (`ChunkKernels`);
eager, each holds one fp32 copy of the chunk at a time. `vocab_parallel_cross_entropy` computes the
per-token loss of given logits (``(tokens, V/tp)``, or every virtual rank's columns of an emulated
model's full logits) chunk by chunk, forward and backward: no fp32 ``(tokens, V/tp)`` tensor, and in
backward one gradient of the logits' own size and dtype, as autograd of the unfused loss writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

# fp32 logits of one chunk (every local rank's): the loss's working set; the fused loss also reads
# and writes the fp32 weight gradient once per chunk (V/tp x h: 0.5 GB at Qwen2.5-0.5B), so fewer,
# larger chunks
CHUNK_BYTES = 512 * 2**20


def chunk_tokens(tokens: int, local_vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: equal chunks whose fp32 logits (``local_vocab`` wide) fit ``chunk_bytes``."""
    chunks = max(1, math.ceil(tokens * local_vocab * 4 / chunk_bytes))
    return max(1, math.ceil(tokens / chunks))


def chunks(tokens: int, chunk: int) -> list[slice]:
    """The row slices of ``tokens`` rows in chunks of ``chunk`` (the last one shorter; no rows: one
    empty chunk, so that the results keep their shapes and their place in the graph)."""
    return [slice(start, min(start + chunk, tokens)) for start in range(0, max(tokens, 1), chunk)]


# -- the chunk kernels ---------------------------------------------------------------------------

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


def softmax_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int,
                 weight: torch.Tensor | float, entropy: tuple[torch.Tensor, torch.Tensor] | None = None,
                 logit_scale: float = 1.0) -> torch.Tensor:
    """The gradient of one rank's chunk of logits (n, V/tp), in their dtype, of
    ``sum_i weight_i * (lse_i - z_i[target_i])``, plus ``sum_i v_i * H_i`` where ``entropy`` is
    ``(mean_z, v)``: ``z = logit_scale * logits``, ``lse`` (n,) its global log-sum-exp, ``H`` the
    entropy of ``softmax(z)`` and ``mean_z = lse - H`` its mean logit. ``weight``: (n,) or a number;
    0 on tokens whose target is ``ignore_index``::

        p = exp(z - lse);  g = (p - onehot(target)) * weight + p * (z - mean_z) * v;  return g * logit_scale

    Pointwise only (the one-hot is a comparison with the column index, not a scatter), so a compiler
    fuses it into one kernel that reads the logits once and writes the result; eager, the fp32
    ``p`` is updated in place."""
    z = logits.float() if logit_scale == 1.0 else logits.float() * logit_scale
    p = (z - lse.unsqueeze(-1)).exp()
    hit = torch.arange(logits.shape[-1], device=logits.device) == (target - vocab_start).unsqueeze(-1)
    w = weight.unsqueeze(-1) if isinstance(weight, torch.Tensor) else weight
    if entropy is None:
        g = p.add_(hit, alpha=-1).mul_(w)
    else:
        mean_z, v = entropy
        g = (p * (z - mean_z.unsqueeze(-1))).mul_(v.unsqueeze(-1)).add_(p.add_(hit, alpha=-1).mul_(w))
    if logit_scale != 1.0:
        g = g.mul_(logit_scale)
    return g.masked_fill_((target == ignore_index).unsqueeze(-1), 0.0).to(logits.dtype)


# the per-token figures TRL's fused LM head returns besides the log-probability, and the per-rank
# numbers each needs (`local_token_stats`): rows after the log-sum-exp and the target logit
TOKEN_STATS = {"entropy": ("mean_z",), "log_sum_sq_probs": ("log_sum_sq",), "mean_logits": ("sum_z",),
               "is_top1": ("max", "max_before")}


def local_token_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, logit_scale: float,
                      wanted: tuple[str, ...]) -> torch.Tensor:
    """(K, n) fp32 of one rank's chunk (n, V/tp) of ``z = logit_scale * logits``: its log-sum-exp,
    the target logit where the target is in its rows (0 elsewhere), then for each of ``wanted``
    (`TOKEN_STATS`) its rows: ``sum softmax_r(z) z`` (entropy), ``logsumexp 2 (z - lse_r)``
    (log sum of squared probabilities), ``sum z`` (mean logit), the largest logit and the largest
    one left of the target's column in the whole vocabulary (whether the target is the first top-1)."""
    z = logits.float() * logit_scale
    local_vocab = z.shape[-1]
    local_target = target - vocab_start
    mine = (local_target >= 0) & (local_target < local_vocab)
    lse = torch.logsumexp(z, dim=-1)
    rows = [lse, z.gather(-1, local_target.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1) * mine]
    if "entropy" in wanted:
        rows.append(((z - lse.unsqueeze(-1)).exp() * z).sum(-1))
    if "log_sum_sq_probs" in wanted:
        rows.append(torch.logsumexp(2 * (z - lse.unsqueeze(-1)), dim=-1))
    if "mean_logits" in wanted:
        rows.append(z.sum(-1))
    if "is_top1" in wanted:
        before = torch.arange(local_vocab, device=z.device) < local_target.unsqueeze(-1)
        rows += [z.amax(-1), z.masked_fill(~before, -math.inf).amax(-1)]
    return torch.stack(rows)


def combine_token_stats(parts: torch.Tensor, vocab_size: int, wanted: tuple[str, ...]) -> list[torch.Tensor | None]:
    """From every rank's `local_token_stats` stacked (tp, K, n): ``[lse, log_prob, entropy,
    log_sum_sq_probs, mean_logits, is_top1]`` per token, None for a figure not ``wanted``."""
    lse_r, lse = parts[:, 0], torch.logsumexp(parts[:, 0], dim=0)
    target = parts[:, 1].sum(0)
    out: list[torch.Tensor | None] = [lse, target - lse, None, None, None, None]
    row = 2
    for slot, name in enumerate(("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), start=2):
        if name not in wanted:
            continue
        if name == "entropy":
            out[slot] = lse - ((lse_r - lse).exp() * parts[:, row]).sum(0)
        elif name == "log_sum_sq_probs":
            out[slot] = torch.logsumexp(parts[:, row] + 2 * lse_r, dim=0) - 2 * lse
        elif name == "mean_logits":
            out[slot] = parts[:, row].sum(0) / vocab_size
        else:
            out[slot] = (target >= parts[:, row].amax(0)) & (target > parts[:, row + 1].amax(0))
        row += len(TOKEN_STATS[name])
    return out


class ChunkKernels:
    """The chunk kernels, eager or each compiled by ``torch.compile(backend=...)`` (lazily, at its
    first call). Dynamo sees one chunk's shapes; chunks of another length (the last one, another
    batch) are its usual shape changes."""

    KERNELS = {"parts": local_loss_parts, "combine": combine_loss_parts, "grad": softmax_grad,
               "stats": local_token_stats, "combine_stats": combine_token_stats}

    def __init__(self, backend: str | Callable | None = None) -> None:
        self.backend = backend
        for name, kernel in self.KERNELS.items():
            setattr(self, name, kernel if backend is None else torch.compile(kernel, backend=backend))


EAGER = ChunkKernels()


# -- the loss over given logits ------------------------------------------------------------------

class LogitsSpec:
    """Where each local rank's vocabulary slice lies: ``columns[r]`` of the logits, starting at row
    ``vocab_starts[r]`` of the full vocabulary; the gather of every rank's loss parts, the ignore
    index, the tokens per chunk and the kernels."""

    def __init__(self, columns: Sequence[tuple[int, int]], vocab_starts: Sequence[int], gather_parts: Callable,
                 ignore_index: int, chunk: int, kernels: ChunkKernels) -> None:
        self.columns, self.vocab_starts, self.gather_parts = list(columns), list(vocab_starts), gather_parts
        self.ignore_index, self.chunk, self.kernels = ignore_index, chunk, kernels


def _logits_loss(logits: torch.Tensor, target: torch.Tensor, spec: LogitsSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and global log-sum-exp (tokens,), fp32, chunk by chunk."""
    k, tokens = spec.kernels, target.shape[0]
    losses = torch.empty(tokens, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    for rows in chunks(tokens, spec.chunk):
        t = target[rows]
        parts = torch.stack([k.parts(logits[rows, lo:hi], t, start, spec.ignore_index)
                             for (lo, hi), start in zip(spec.columns, spec.vocab_starts)])
        parts = spec.gather_parts(parts)  # (tp, 2, n)
        losses[rows] = k.combine(parts, t == spec.ignore_index)
        lse[rows] = torch.logsumexp(parts[:, 0], dim=0)
    return losses, lse


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: the per-token loss of (tokens, W) logits; backward: their gradient, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, target, spec):
        losses, lse = _logits_loss(logits, target, spec)
        ctx.save_for_backward(logits, target, lse)
        ctx.spec = spec
        return losses

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        spec, k = ctx.spec, ctx.spec.kernels
        out = torch.empty_like(logits)
        for rows in chunks(target.shape[0], spec.chunk):
            for (lo, hi), start in zip(spec.columns, spec.vocab_starts):
                out[rows, lo:hi] = k.grad(logits[rows, lo:hi], lse[rows], target[rows], start, spec.ignore_index,
                                          grad[rows].float())
        return out, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_starts: Sequence[int], gather_parts: Callable[[torch.Tensor], torch.Tensor],
    *, columns: Sequence[tuple[int, int]] | None = None, ignore_index: int = -100, chunk: int | None = None,
    kernels: ChunkKernels = EAGER,
) -> torch.Tensor:
    """Per-token loss (``target``'s shape, fp32; 0 where ``target == ignore_index``) of logits that
    hold vocabulary slices: ``logits`` (..., W), in ``columns[r]`` (default: all W) the rows of the
    full vocabulary from ``vocab_starts[r]`` on, one (lo, hi) per rank held here (real TP: one; an
    emulated model: every virtual rank's columns of its full logits). ``target``: (...) ids in the
    full vocabulary. ``gather_parts``: the local ranks' loss parts stacked (R, 2, n) -> every rank's
    (tp, 2, n) (real TP: the all-gather over the group, which must be plain: exact; else the
    identity). Differentiable in ``logits``; exact up to fp32 rounding. ``chunk``: tokens per chunk
    (default `chunk_tokens`)."""
    width = logits.shape[-1]
    columns = [(0, width)] if columns is None else list(columns)
    if len(columns) != len(vocab_starts):
        raise ValueError(f"{len(columns)} column ranges and {len(vocab_starts)} vocabulary starts: one of each per local rank")
    flat, t = logits.reshape(-1, width), target.reshape(-1)
    spec = LogitsSpec(columns, vocab_starts, gather_parts, ignore_index,
                      chunk or chunk_tokens(t.shape[0], sum(hi - lo for lo, hi in columns)), kernels)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _VocabParallelCrossEntropy.apply(flat, t, spec).view(target.shape)
    return _logits_loss(flat, t, spec)[0].view(target.shape)
