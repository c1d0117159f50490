"""The vocab-parallel lm head and its loss fused: matmul, loss and gradients in chunks of tokens.

The unfused head computes the logits ``x W^T`` (tokens, V/tp), keeps them (and their fp32 copy)
for the loss's backward, and multiplies again in backward. Here, per chunk of n tokens and per
rank r held in this process (one for real TP, every virtual rank of an emulated group)::

    logits = x_c W_r^T (+ b_r)              (n, V/tp) in the matmul dtype (autocast's, as nn.Linear)
    lse_r, target_r = local_loss_parts       (2, n) fp32
    parts = gather_parts(lse_r, target_r)    (tp, 2, n): the all-gather of `vocab_parallel_cross_entropy`
    lse, target = logsumexp_r lse_r, sum_r target_r
    loss_c = lse - target                    0 on ignored tokens (`combine_loss_parts`)
    g = exp(logits - lse) - onehot(target)   (n, V/tp), 0 on ignored tokens: d loss_c / d logits (`softmax_grad`)
    grad_x_c = g W_r ;  grad_W_r += g^T x_c ;  grad_b_r += sum(g)      (fp32 sums)

so the gradients are computed in the forward, when the logits are at hand, and no tensor of
(tokens, V/tp) outlives its chunk: at most one chunk's logits in the matmul dtype and their fp32
arithmetic (`cross_entropy.CHUNK_BYTES` of fp32 logits per chunk). `fused_linear_cross_entropy` returns the
summed loss; its backward multiplies the kept fp32 gradients by the incoming one (a scalar) and
casts each once to its tensor's dtype. Three matmuls per chunk, as the unfused forward and
backward. What crosses ranks is what the unfused loss sends: the (2, n) parts per chunk at the
plain site ``loss/lse`` (exact), and, outside this function, the input gradient's all-reduce at the
head's ``lm_head/bwd`` site (compressed as before). The gradients live from the forward to the
backward, which frees them: a second backward through the same graph (``retain_graph=True``)
raises (`SECOND_BACKWARD`).

Numerics: in fp32 the loss and gradients equal the unfused ones to fp32 rounding (the same
log-sum-exp per rank, then across ranks; the softmax taken against the global log-sum-exp
directly instead of through the chain rule of the two; the sums over chunks in fp32). In bf16 or
fp16 (autocast or parameters) the matmuls run in that dtype as ``nn.Linear``'s do, ``g`` is rounded
to it once (as the unfused backward rounds the logits' gradient), every product accumulates in
fp32, and the loss's gradient multiplies the fp32 sums before the one cast: the same roundings as
the unfused path. fp16 alone: the gradients are computed before the GradScaler's scale, which
arrives in backward, so ``g`` is multiplied by a power of two before its cast (`chunk_grad_scale`),
keeping softmax entries near 1/V normal; backward divides it out, exactly.

`fused_linear_log_probs` is the per-token form TRL's fused LM head needs (log-probabilities, with
entropy and the other per-token figures): the gradient depends on a per-token incoming gradient,
so its backward recomputes each chunk's logits (four matmuls per chunk) instead of keeping them.

The chunk arithmetic is `cross_entropy`'s kernels (`ChunkKernels`), which ``torch.compile``
fuses; liger-kernel's fused linear cross-entropy does the same for one rank but has no
vocab-parallel form (its softmax needs the log-sum-exp over the whole vocabulary inside its kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .autocast import MatmulCast
from .cross_entropy import EAGER, ChunkKernels, chunk_tokens, chunks

# fp16's smallest normal is 2**-14 and a softmax entry is about 1/V (6.6e-6 at Qwen2.5's 151,936):
# rounded to fp16 as they are, the logit gradients would be subnormals (0 below 6e-8) before the
# GradScaler's scale, which arrives in backward, could lift them. So under fp16 the chunk gradient
# (entries in [-1, 1]) is multiplied by 2**15 before its cast: its largest entry stays below fp16's
# largest, 65504, and entries down to 2**-29 stay normal. Its products have fp32 outputs
# (`_add_product`), and the scale, a power of two, is undone in backward exactly.
FP16_GRAD_SCALE = 2.0**15

SECOND_BACKWARD = ("a second backward through the fused lm head and loss (logits='none'): its gradients, computed "
                   "in the forward, were used and freed by the first backward. Set model.taco_head.mode = 'full' "
                   "(or parallelize / prepare the model with logits='full') to backward through its loss twice")


def chunk_grad_scale(dtype: torch.dtype) -> float:
    """The factor the chunk gradient in ``dtype`` carries (1 but for fp16): a Python constant per
    dtype, so a compiled kernel sees no new value to guard on."""
    return FP16_GRAD_SCALE if dtype == torch.float16 else 1.0


class FusedSpec:
    """What the fused functions need besides tensors: each local rank's first vocabulary row, the
    gather of every rank's loss parts, the ignore index, the tokens per chunk and the kernels."""

    def __init__(self, vocab_starts: Sequence[int], gather_parts: Callable, ignore_index: int, chunk: int,
                 kernels: ChunkKernels) -> None:
        self.vocab_starts, self.gather_parts, self.ignore_index = list(vocab_starts), gather_parts, ignore_index
        self.chunk, self.kernels = chunk, kernels


def _split(tensors: tuple, ranks: int) -> tuple[list, list, list]:
    return list(tensors[:ranks]), list(tensors[ranks:2 * ranks]), list(tensors[2 * ranks:])


class Gradients:
    """The fp32 sums of the gradients of ``(*xs, *weights, *biases)`` (None where not ``wanted``),
    added to chunk by chunk (`add`)."""

    def __init__(self, xs, weights, biases, wanted: Sequence[bool]) -> None:
        ranks = len(xs)
        zeros = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if want else None
                 for t, want in zip([*xs, *weights, *biases], wanted)]
        self.x, self.w, self.b = _split(tuple(zeros), ranks)
        self.b = self.b or [None] * ranks
        self.ranks = [r for r in range(ranks) if any(g is not None for g in (self.x[r], self.w[r], self.b[r]))]
        self.count = len(biases)

    def add(self, r: int, rows: slice, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        """Rank r's chunk ``rows``: its logits' gradient ``g`` (n, V_r), input ``x`` (n, h), weight ``w`` (V_r, h)."""
        if self.x[r] is not None:
            _add_product(self.x[r][rows], g, w)
        if self.w[r] is not None:
            _add_product(self.w[r], g.t(), x)
        if self.b[r] is not None:
            self.b[r] += g.sum(0, dtype=torch.float32)

    def as_list(self) -> list[torch.Tensor | None]:
        return [*self.x, *self.w, *self.b[:self.count]]


def _matmul_operands(weights, biases, dtype: torch.dtype | None, device_type: str):
    """The weights and biases as the chunk matmuls read them (cast once), and the cast of an input
    chunk: to ``dtype``, else as ``nn.Linear`` under the current autocast."""
    cast = MatmulCast(device_type) if dtype is None else (lambda t: None if t is None else t.to(dtype))
    return [cast(w) for w in weights], [cast(b) for b in biases] if biases else [None] * len(weights), cast


def _has_fp32_output_gemm(t: torch.Tensor) -> bool:
    """Whether a product of ``t`` has one GEMM with an fp32 output (CUDA sm80 on, bf16 / fp16)."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(t.device)[0] >= 8


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` (fp32) += ``a @ b``: on CUDA (sm80 on) one GEMM with an fp32 output accumulating into
    ``out`` for bf16 / fp16 operands; elsewhere low-precision operands multiplied in fp32 (the
    products of fp16's scaled gradient can pass fp16's range, `FP16_GRAD_SCALE`; no output rounding)."""
    if a.dtype == torch.float32:
        out.addmm_(a, b)
    elif _has_fp32_output_gemm(a):
        torch.addmm(out, a, b, torch.float32, out=out)
    else:
        with torch.autocast(a.device.type, enabled=False):  # on, it would multiply in low precision again
            out.addmm_(a.float(), b.float())


# -- the summed loss, gradients computed in the forward --------------------------------------------

def _loss_and_grads(xs, weights, biases, target, spec: FusedSpec, wanted: Sequence[bool]):
    """The summed loss (fp32, 0-d), the fp32 gradients of ``(*xs, *weights, *biases)`` (None unless
    ``wanted``) times the scale they carry (`chunk_grad_scale`), and that scale."""
    k, ignore = spec.kernels, spec.ignore_index
    ws, bs, cast = _matmul_operands(weights, biases, None, xs[0].device.type)
    scale = chunk_grad_scale(ws[0].dtype)  # the logits' dtype
    grads = Gradients(xs, weights, biases, wanted)
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    for rows in chunks(target.shape[0], spec.chunk):
        t = target[rows]
        x_c = [cast(x[rows]) for x in xs]
        logits = [F.linear(x, w, b) for x, w, b in zip(x_c, ws, bs)]  # R x (n, V/tp)
        parts = spec.gather_parts(torch.stack([k.parts(z, t, v0, ignore) for z, v0 in zip(logits, spec.vocab_starts)]))
        total = total + k.combine(parts, t == ignore).sum()  # parts: (tp, 2, n), every rank's
        if not grads.ranks:
            continue
        lse = torch.logsumexp(parts[:, 0], dim=0)  # (n,)
        for r in grads.ranks:
            g = k.grad(logits[r], lse, t, spec.vocab_starts[r], ignore, scale)  # (n, V/tp)
            logits[r] = None  # one chunk's logits alive at a time
            grads.add(r, rows, g, x_c[r], ws[r])
    return total, grads.as_list(), scale


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss, and every gradient (see the module doc); backward: the kept
    gradients times the loss's gradient, each cast once."""

    @staticmethod
    def forward(ctx, target, spec, *tensors):
        ranks = len(spec.vocab_starts)
        xs, weights, biases = _split(tensors, ranks)
        loss, ctx.grads, ctx.scale = _loss_and_grads(xs, weights, biases, target, spec, ctx.needs_input_grad[2:])
        ctx.dtypes = [t.dtype for t in tensors]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(SECOND_BACKWARD)
        grads, ctx.grads = ctx.grads, None  # ours alone: scaled in place, freed on return
        factor = grad_loss.float() / ctx.scale  # exact: the scale is a power of two
        return (None, None, *[None if g is None else g.mul_(factor).to(dtype) for g, dtype in zip(grads, ctx.dtypes)])


def _check(xs, weights, vocab_starts, biases) -> list:
    biases = list(biases) if biases is not None and any(b is not None for b in biases) else []
    if len(xs) != len(weights) or len(xs) != len(vocab_starts):
        raise ValueError(f"{len(xs)} inputs, {len(weights)} weights and {len(vocab_starts)} vocabulary starts: "
                         "pass one of each per local rank")
    if biases and any(b is None for b in biases):
        raise ValueError("either every local rank's head has a bias or none does")
    return biases


def fused_linear_cross_entropy(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], target: torch.Tensor, vocab_starts: Sequence[int],
    gather_parts: Callable[[torch.Tensor], torch.Tensor], *, biases: Sequence[torch.Tensor | None] | None = None,
    ignore_index: int = -100, chunk: int | None = None, kernels: ChunkKernels = EAGER,
) -> torch.Tensor:
    """The summed next-token loss of the head ``x W_r^T (+ b_r)`` over the vocabulary slices
    held here, fp32, 0-d; differentiable in ``xs``, ``weights``, ``biases`` (once: `SECOND_BACKWARD`).

    ``xs``: per local rank, its (tokens, h) input (the same values; real TP: one); ``weights``:
    per local rank its (V_r, h) rows, starting at ``vocab_starts[r]`` of the full vocabulary;
    ``target``: (tokens,) ids in the full vocabulary, ``ignore_index`` not scored;
    ``gather_parts``: the local ranks' loss parts stacked (R, 2, n) -> every rank's (tp, 2, n)
    (real TP: the all-gather over the group; emulated and tp=1: the identity). ``chunk``: tokens
    per chunk (default `chunk_tokens`)."""
    biases = _check(xs, weights, vocab_starts, biases)
    chunk = chunk or chunk_tokens(target.shape[0], sum(w.shape[0] for w in weights))
    spec = FusedSpec(vocab_starts, gather_parts, ignore_index, chunk, kernels)
    if not torch.is_grad_enabled():  # evaluation: the loss alone
        return _loss_and_grads(xs, weights, biases, target, spec, [False] * (len(xs) + len(weights) + len(biases)))[0]
    return _FusedLinearCrossEntropy.apply(target, spec, *xs, *weights, *biases)


# -- per-token log-probabilities, gradients recomputed in backward ---------------------------------

class TokenSpec(FusedSpec):
    """`FusedSpec` and what the per-token figures need: the logits' scale (TRL's ``logit_scale /
    temperature``), the figures ``wanted`` besides the log-probability, the vocabulary size and
    the matmul dtype."""

    def __init__(self, vocab_starts, gather_parts, chunk, kernels, *, logit_scale: float, wanted: tuple[str, ...],
                 vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__(vocab_starts, gather_parts, -100, chunk, kernels)
        self.logit_scale, self.wanted, self.vocab_size, self.dtype = logit_scale, wanted, vocab_size, dtype


def _token_stats(xs, weights, biases, target, spec: TokenSpec) -> list[torch.Tensor | None]:
    """``[lse, log_prob, entropy, log_sum_sq_probs, mean_logits, is_top1]`` per token (None: not wanted)."""
    k, tokens = spec.kernels, target.shape[0]
    ws, bs, cast = _matmul_operands(weights, biases, spec.dtype, xs[0].device.type)
    pieces = []
    for rows in chunks(tokens, spec.chunk):
        t = target[rows]
        parts = torch.stack([k.stats(F.linear(cast(x[rows]), w, b), t, v0, spec.logit_scale, spec.wanted)
                             for x, w, b, v0 in zip(xs, ws, bs, spec.vocab_starts)])
        pieces.append(k.combine_stats(spec.gather_parts(parts), spec.vocab_size, spec.wanted))
    return [None if piece[0] is None else torch.cat(list(piece)) for piece in zip(*pieces)]


class _FusedLinearLogProbs(torch.autograd.Function):
    """Forward: per-token figures (`_token_stats`); backward: each chunk's logits again, their
    gradient (`softmax_grad` with the per-token incoming gradients) and its products."""

    @staticmethod
    def forward(ctx, target, spec, *tensors):
        ctx.set_materialize_grads(False)  # the entropy's gradient is often None (a metric)
        xs, weights, biases = _split(tensors, len(spec.vocab_starts))
        lse, log_probs, entropy, log_sum_sq, mean_logits, top1 = _token_stats(xs, weights, biases, target, spec)
        mean_z = lse - entropy if entropy is not None else lse  # (a placeholder without entropy)
        ctx.save_for_backward(target, lse, mean_z, *tensors)
        ctx.spec = spec
        ctx.mark_non_differentiable(*(t for t in (log_sum_sq, mean_logits, top1) if t is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, top1

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        target, lse, mean_z, *tensors = ctx.saved_tensors
        spec, k = ctx.spec, ctx.spec.kernels
        xs, weights, biases = _split(tuple(tensors), len(spec.vocab_starts))
        grads = Gradients(xs, weights, biases, ctx.needs_input_grad[2:])
        if grad_log_probs is None and grad_entropy is None:
            return (None, None, *[None] * len(tensors))
        ws, bs, cast = _matmul_operands(weights, biases, spec.dtype, xs[0].device.type)
        for rows in chunks(target.shape[0], spec.chunk):
            t = target[rows]
            # d/dz of a * log p (a: the incoming gradient) is -(p - onehot) a: the weight is -a
            weight = 0.0 if grad_log_probs is None else -grad_log_probs[rows].float()
            entropy = None if grad_entropy is None else (mean_z[rows], -grad_entropy[rows].float())
            for r in grads.ranks:
                x_c = cast(xs[r][rows])
                g = k.grad(F.linear(x_c, ws[r], bs[r]), lse[rows], t, spec.vocab_starts[r], spec.ignore_index,
                           weight, entropy, spec.logit_scale)
                grads.add(r, rows, g, x_c, ws[r])
        return (None, None, *[None if g is None else g.to(t.dtype) for g, t in zip(grads.as_list(), tensors)])


def fused_linear_log_probs(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], target: torch.Tensor, vocab_starts: Sequence[int],
    gather_parts: Callable[[torch.Tensor], torch.Tensor], *, vocab_size: int, dtype: torch.dtype,
    biases: Sequence[torch.Tensor | None] | None = None, logit_scale: float = 1.0, wanted: tuple[str, ...] = (),
    chunk: int | None = None, kernels: ChunkKernels = EAGER,
) -> tuple[torch.Tensor | None, ...]:
    """Per token of ``target`` (tokens,), under ``z = logit_scale * (x W^T + b)`` over the whole
    vocabulary (its slices held here, as `fused_linear_cross_entropy` reads them): ``(log_prob,
    entropy, log_sum_sq_probs, mean_logits, is_top1)``, fp32 (``is_top1`` bool), each but the
    log-probability None unless ``wanted``; the log-probability and entropy differentiable in
    ``xs``, ``weights``, ``biases``. TRL's fused LM head's figures (`cross_entropy.TOKEN_STATS`).
    ``dtype``: the matmuls' dtype (the chunk of ``x`` and the weights are cast to it)."""
    biases = _check(xs, weights, vocab_starts, biases)
    chunk = chunk or chunk_tokens(target.shape[0], sum(w.shape[0] for w in weights))
    spec = TokenSpec(vocab_starts, gather_parts, chunk, kernels, logit_scale=logit_scale, wanted=tuple(wanted),
                     vocab_size=vocab_size, dtype=dtype)
    tensors = [*xs, *weights, *biases]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return tuple(_token_stats(xs, weights, biases, target, spec)[1:])
    return _FusedLinearLogProbs.apply(target, spec, *tensors)
