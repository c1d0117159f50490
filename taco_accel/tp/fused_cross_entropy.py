"""The vocab-parallel lm head and cross-entropy fused: matmul, loss and gradients in chunks of tokens.

The unfused head computes the logits ``x W^T`` (tokens, V/tp), keeps them (and their fp32 copy)
for the loss's backward, and multiplies again in backward. Here, per chunk of n tokens and per
rank r held in this process (one for real TP, every virtual rank of an emulated group)::

    logits = x_c W_r^T (+ b_r)              (n, V/tp) in the matmul dtype (autocast's, as nn.Linear)
    lse_r, target_r = local_loss_parts       (2, n) fp32
    parts = gather_parts(lse_r, target_r)    (tp, 2, n): the all-gather of `vocab_parallel_cross_entropy`
    lse, target = logsumexp_r lse_r, sum_r target_r
    loss_c = lse - target                    0 on ignored tokens (`combine_loss_parts`)
    g = exp(logits - lse) - onehot(target)   (n, V/tp), 0 on ignored tokens: d loss_c / d logits
    grad_x_c = g W_r ;  grad_W_r += g^T x_c (fp32) ;  grad_b_r += sum(g)

so the gradients are computed in the forward, when the logits are at hand, and no tensor of
(tokens, V/tp) outlives its chunk: at most one chunk's logits in the matmul dtype and their fp32
arithmetic (`CHUNK_BYTES` of fp32 logits per chunk). The function returns the summed loss; its
backward multiplies the kept gradients by the incoming one (a scalar). Three matmuls per chunk,
as the unfused forward and backward. What crosses ranks is what the unfused loss sends: the
(2, n) parts per chunk at the plain site ``loss/lse`` (exact), and, outside this function, the
input gradient's all-reduce at the head's ``lm_head/bwd`` site (compressed as before).

Numerics: in fp32 the loss and gradients equal the unfused ones to fp32 rounding (the same
log-sum-exp per rank, then across ranks; the softmax taken against the global log-sum-exp
directly instead of through the chain rule of the two; the weight gradient summed over chunks in
fp32). Under autocast the matmuls run in its dtype as ``nn.Linear``'s do; the weight gradient is
summed in fp32 (the unfused head rounds it to the autocast dtype once). Under fp16 (autocast or
parameters) the gradients are computed before the GradScaler's scale, which arrives in backward:
``g`` is scaled by a power of two before its fp16 cast (`FP16_GRAD_SCALE`), so that softmax
entries near 1/V stay normal, and the gradients stay in fp32 until backward unscales them.

The chunk arithmetic (log-sum-exp, softmax gradient) is two pure functions that
``torch.compile`` fuses into a few kernels when the model is compiled (``compile=`` the backend):
torch's own compiler, not a kernel of ours. liger-kernel's fused linear cross-entropy does the
same for one rank but has no vocab-parallel form (its softmax needs the log-sum-exp over the whole
vocabulary inside its kernel) and does not compile under dynamo.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .autocast import MatmulCast
from .cross_entropy import combine_loss_parts, local_loss_parts

# fp32 logits of one chunk (every local rank's): the loss's working set; each chunk also reads and
# writes the fp32 weight gradient once (V/tp x h: 0.5 GB at Qwen2.5-0.5B), so fewer, larger chunks
CHUNK_BYTES = 512 * 2**20


def chunk_tokens(tokens: int, local_vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: equal chunks whose fp32 logits (``local_vocab`` wide) fit ``chunk_bytes``."""
    chunks = max(1, math.ceil(tokens * local_vocab * 4 / chunk_bytes))
    return max(1, math.ceil(tokens / chunks))


# fp16's smallest normal is 2**-14 and a softmax entry is about 1/V (6.6e-6 at Qwen2.5's 151,936):
# rounded to fp16 as they are, the logit gradients would be subnormals (0 below 6e-8) before the
# GradScaler's scale, which arrives in backward, could lift them. So under fp16 the chunk gradient
# (entries in [-1, 1]) is multiplied by 2**15 before its cast: its largest entry stays below fp16's
# largest, 65504, and entries down to 2**-29 stay normal. The scaled gradient's products have fp32
# outputs (`_add_product`; an fp16 output could overflow whatever the weights), the gradients stay in
# fp32 until backward, and the scale, a power of two, is undone there exactly with the loss's gradient.
FP16_GRAD_SCALE = 2.0**15


def chunk_grad_scale(dtype: torch.dtype) -> float:
    """The factor `softmax_grad` applies to the chunk gradient in ``dtype`` (1 but for fp16): a Python
    constant per dtype, so a compiled `ChunkKernels` sees no new value to guard on."""
    return FP16_GRAD_SCALE if dtype == torch.float16 else 1.0


def softmax_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, vocab_start: int,
                 ignore_index: int) -> torch.Tensor:
    """d loss / d logits of one rank's chunk (n, V/tp) times `chunk_grad_scale`, in the logits'
    dtype: the softmax against the global log-sum-exp ``lse`` (n,) minus the one-hot target where
    this rank holds it; 0 on ignored tokens."""
    scale = chunk_grad_scale(logits.dtype)
    local_target = (target - vocab_start).unsqueeze(-1)
    scored = (target != ignore_index).unsqueeze(-1)
    if torch.compiler.is_compiling():
        # pointwise only, so the compiler fuses it into one kernel that reads the logits and writes the
        # result (a scatter would make it write and read an fp32 (n, V/tp) tensor first: 3x the traffic)
        p = torch.exp(logits.float() - lse.unsqueeze(-1))
        hit = torch.arange(logits.shape[-1], device=logits.device) == local_target  # none outside this rank's slice
        return torch.where(scored, torch.where(hit, p - 1.0, p) * scale, 0.0).to(logits.dtype)
    # eager: the same values in place, one fp32 (n, V/tp) tensor
    grad = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    mine = (local_target >= 0) & (local_target < logits.shape[-1]) & scored
    columns = local_target.clamp(0, max(logits.shape[-1] - 1, 0))
    grad.scatter_add_(-1, columns, -mine.to(grad.dtype))  # minus the one-hot target
    grad.masked_fill_(~scored, 0.0)
    if scale != 1.0:
        grad.mul_(scale)  # exact: a power of two, in fp32
    return grad.to(logits.dtype)


class ChunkKernels:
    """The chunk arithmetic, eager or compiled by ``torch.compile(backend=...)`` (built once)."""

    def __init__(self, backend: str | Callable | None = None) -> None:
        self.backend = backend
        self.parts, self.grad, self.combine = local_loss_parts, softmax_grad, combine_loss_parts
        if backend is not None:
            self.parts = torch.compile(local_loss_parts, backend=backend)
            self.grad = torch.compile(softmax_grad, backend=backend)
            self.combine = torch.compile(combine_loss_parts, backend=backend)


EAGER = ChunkKernels()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss, and every gradient (see the module doc); backward: the kept
    gradients times the loss's gradient."""

    @staticmethod
    def forward(ctx, target, spec, *tensors):
        ranks = len(spec.vocab_starts)
        xs, weights, biases = tensors[:ranks], tensors[ranks:2 * ranks], tensors[2 * ranks:]
        loss, ctx.grads, ctx.scale = _chunked(xs, weights, biases, target, spec, ctx.needs_input_grad[2:])
        ctx.dtypes = [t.dtype for t in tensors]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None  # ours alone: scaled in place
        factor = grad_loss / ctx.scale  # exact: the scale is a power of two
        return (None, None, *[None if g is None else g.mul_(factor.to(g.dtype)).to(dtype)
                              for g, dtype in zip(grads, ctx.dtypes)])


class FusedSpec:
    """What `_FusedLinearCrossEntropy` needs besides tensors: each local rank's first vocabulary
    row, the gather of every rank's loss parts, the ignore index, the chunk size and the kernels."""

    def __init__(self, vocab_starts: Sequence[int], gather_parts: Callable, ignore_index: int, chunk: int,
                 kernels: ChunkKernels) -> None:
        self.vocab_starts, self.gather_parts, self.ignore_index = list(vocab_starts), gather_parts, ignore_index
        self.chunk, self.kernels = chunk, kernels


def _chunked(xs, weights, biases, target, spec: FusedSpec, wanted: Sequence[bool]):
    """The summed loss, the gradients of ``(*xs, *weights, *biases)``, each None unless ``wanted``
    (flags in that order; none wanted: the loss alone), and the scale they carry: under fp16 they
    are fp32 and `chunk_grad_scale` times the true ones, else in their tensors' dtypes and exact."""
    ranks, tokens, k = len(xs), target.shape[0], spec.kernels
    cast = MatmulCast(xs[0].device.type)
    ws = [cast(w) for w in weights]  # once, as nn.Linear under autocast casts its weight
    bs = [cast(b) for b in biases] if biases else [None] * ranks
    scale = chunk_grad_scale(ws[0].dtype)  # the logits' dtype
    scaled = scale != 1.0  # fp16: every gradient kept in fp32, times `scale`, until backward
    # without an fp32-output GEMM the scaled products multiply in fp32 (`_add_product`): the weights
    # cast once here, not once per chunk
    product_ws = [w.float() for w in ws] if scaled and not _has_fp32_output_gemm(ws[0]) else ws
    want_x, want_w, want_b = wanted[:ranks], wanted[ranks:2 * ranks], list(wanted[2 * ranks:]) or [False] * ranks
    fp32_zeros = lambda t, want: torch.zeros(t.shape, dtype=torch.float32, device=t.device) if want else None  # noqa: E731
    if scaled:
        grad_x = [fp32_zeros(x, want) for x, want in zip(xs, want_x)]
    else:
        grad_x = [torch.empty_like(x) if want else None for x, want in zip(xs, want_x)]
    grad_w = [fp32_zeros(w, want) for w, want in zip(weights, want_w)]
    grad_b = [fp32_zeros(b, want) for b, want in zip(bs, want_b)]
    trains = [x or w or b for x, w, b in zip(want_x, want_w, want_b)]
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    for start in range(0, tokens, spec.chunk):
        rows = slice(start, min(start + spec.chunk, tokens))
        t = target[rows]
        x_c = [cast(x[rows]) for x in xs]
        logits = [F.linear(x, w, b) for x, w, b in zip(x_c, ws, bs)]  # R x (n, V/tp)
        parts = torch.stack([k.parts(z, t, v0, spec.ignore_index) for z, v0 in zip(logits, spec.vocab_starts)])
        parts = spec.gather_parts(parts)  # (tp, 2, n): every rank's log-sum-exp and target logit
        total = total + k.combine(parts, t == spec.ignore_index).sum()
        if not any(trains):
            continue
        lse = torch.logsumexp(parts[:, 0], dim=0)  # (n,)
        for r in (r for r in range(ranks) if trains[r]):
            g = k.grad(logits[r], lse, t, spec.vocab_starts[r], spec.ignore_index)  # (n, V/tp)
            logits[r] = None  # one chunk's logits alive at a time
            if grad_x[r] is not None and scaled:
                _add_product(grad_x[r][rows], g, product_ws[r])
            elif grad_x[r] is not None:
                grad_x[r][rows] = g @ ws[r]
            if grad_w[r] is not None:
                _add_product(grad_w[r], g.t(), x_c[r])
            if grad_b[r] is not None:
                grad_b[r] += g.float().sum(0)
    grads = grad_x + grad_w + grad_b[:len(biases)]
    if not scaled:
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, [*xs, *weights, *biases])]
    return total, grads, scale


def _has_fp32_output_gemm(t: torch.Tensor) -> bool:
    """Whether a product of ``t`` has one GEMM with an fp32 output (CUDA sm80 on, bf16 / fp16)."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(t.device)[0] >= 8


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` (fp32) += ``a @ b``: on CUDA (sm80 on) one GEMM with an fp32 output accumulating into
    ``out`` for bf16 / fp16 operands; elsewhere fp16 operands multiplied in fp32 (the scaled chunk
    gradient's products can pass fp16's range, `FP16_GRAD_SCALE`), the others in their dtype."""
    if _has_fp32_output_gemm(a):
        torch.addmm(out, a, b, torch.float32, out=out)
    elif a.dtype == torch.float16:
        with torch.autocast(a.device.type, enabled=False):  # on, it would multiply in fp16 again
            out.addmm_(a.float(), b.float())
    else:
        out += (a @ b).float()


def fused_linear_cross_entropy(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], target: torch.Tensor, vocab_starts: Sequence[int],
    gather_parts: Callable[[torch.Tensor], torch.Tensor], *, biases: Sequence[torch.Tensor | None] | None = None,
    ignore_index: int = -100, chunk: int | None = None, kernels: ChunkKernels = EAGER,
) -> torch.Tensor:
    """The summed next-token loss of the head ``x W_r^T (+ b_r)`` over the vocabulary slices
    held here, fp32, 0-d; differentiable in ``xs``, ``weights``, ``biases``.

    ``xs``: per local rank, its (tokens, h) input (the same values; real TP: one); ``weights``:
    per local rank its (V_r, h) rows, starting at ``vocab_starts[r]`` of the full vocabulary;
    ``target``: (tokens,) ids in the full vocabulary, ``ignore_index`` not scored;
    ``gather_parts``: the local ranks' loss parts stacked (R, 2, n) -> every rank's (tp, 2, n)
    (real TP: the all-gather over the group; emulated: the identity). ``chunk``: tokens per chunk
    (default `chunk_tokens`)."""
    biases = list(biases) if biases is not None and any(b is not None for b in biases) else []
    if len(xs) != len(weights) or len(xs) != len(vocab_starts):
        raise ValueError(f"{len(xs)} inputs, {len(weights)} weights and {len(vocab_starts)} vocabulary starts: "
                         "pass one of each per local rank")
    if biases and any(b is None for b in biases):
        raise ValueError("either every local rank's head has a bias or none does")
    if chunk is None:
        chunk = chunk_tokens(target.shape[0], sum(w.shape[0] for w in weights))
    spec = FusedSpec(vocab_starts, gather_parts, ignore_index, chunk, kernels)
    if not torch.is_grad_enabled():  # evaluation: the loss alone
        return _chunked(xs, weights, biases, target, spec, [False] * (len(xs) + len(weights) + len(biases)))[0]
    return _FusedLinearCrossEntropy.apply(target, spec, *xs, *weights, *biases)
