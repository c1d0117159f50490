"""The head and loss of `taco_accel.models.loss` and their chunked functions (`tp.fused_cross_entropy`,
`tp.cross_entropy`), in one process.

Against the unfused computation each replaces (the head's matmul, then per-vocabulary-slice loss
parts and their combination, autograd for the gradients): the summed loss and every gradient in
fp32 over chunks that do not divide the tokens, with a bias, ignored tokens and a vocabulary split
over 1 to 3 ranks; the loss over given logits; TRL's per-token figures; the largest tensors they
allocate (one chunk's logits, never the (tokens, V/tp) ones, and no fp32 tensor of that size); bf16
gradients cast once; fp16 at a large vocabulary. The model's forward (`models.loss.CausalLMHead`) at
tp=1 and emulated tp=2 against the plain transformers model: every logits mode, its outputs (cache,
hidden states, tuples, ``logits_to_keep``, generation), a ``loss_function`` of one's own, peft, TRL's
fused LM head. Real TP over gloo ranks is in tests/test_parallelize.py (fp32, every family, tp 2
and 4) and tests/test_precision.py (bf16 autocast and parameters), every entry point at tp=1 and 2
in tests/test_entry_matrix.py (which path each one's loss took).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from harness import UNIT as FP32_UNIT
from harness import TINY_MODEL_FP32, fp32_bound, lm_batch, loss_paths
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import taco_accel
from taco_accel import comm
from taco_accel.models.loss import install_head
from taco_accel.models.tiny import tiny_model
from taco_accel.tp.cross_entropy import (CHUNK_BYTES, ChunkKernels, chunk_tokens, combine_loss_parts, local_loss_parts,
                                         vocab_parallel_cross_entropy)
from taco_accel.tp.fused_cross_entropy import SECOND_BACKWARD, fused_linear_cross_entropy, fused_linear_log_probs

TOKENS, HIDDEN, VOCAB = 23, 16, 40
# fp32, any order: each logit a sum of HIDDEN products; the loss a sum over <= TOKENS tokens of
# log-sum-exps of O(1) logits over VOCAB entries; a gradient a sum of TOKENS (weight) or VOCAB
# (input) products: sums of at most 64 terms whose magnitudes add up to less than 100
FP32 = fp32_bound(64, 100.0)
# a tiny model fused against the plain one, as tests/test_parallelize.py bounds a parallel model
# against one process
MODEL_FP32 = TINY_MODEL_FP32
BF16_UNIT = 2.0**-8


def _problem(ranks: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    b = torch.randn(VOCAB, generator=g) if bias else None
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    target[::4] = -100  # ignored tokens
    bounds = [round(r * VOCAB / ranks) for r in range(ranks + 1)]  # uneven slices for 3 ranks
    return x, weight, b, target, list(zip(bounds[:-1], bounds[1:]))


def _unfused(x, weight, b, target, slices):
    """The loss and gradients the fused function replaces: every rank's logits, then the loss parts."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    logits = torch.nn.functional.linear(x, weight, b)  # (tokens, V)
    parts = torch.stack([local_loss_parts(logits[:, lo:hi], target, lo) for lo, hi in slices])
    loss = combine_loss_parts(parts, target == -100).sum()
    loss.backward()
    return loss.detach(), [x.grad, weight.grad, None if b is None else b.grad]


def _fused(x, weight, b, target, slices, chunk, kernels=None):
    """The fused function with one input copy per rank (an emulated group's layout)."""
    xs = [x.clone().requires_grad_() for _ in slices]
    full_w, full_b = weight.clone().requires_grad_(), None if b is None else b.clone().requires_grad_()
    weights = [full_w[lo:hi] for lo, hi in slices]
    biases = None if full_b is None else [full_b[lo:hi] for lo, hi in slices]
    extra = {} if kernels is None else {"kernels": kernels}
    loss = fused_linear_cross_entropy(xs, weights, target, [lo for lo, _ in slices], lambda parts: parts,
                                      biases=biases, chunk=chunk, **extra)
    (loss * 0.5).backward()  # the incoming gradient scales the kept ones
    return loss.detach(), [sum(x.grad for x in xs) * 2, full_w.grad * 2, None if full_b is None else full_b.grad * 2]


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1, 5, TOKENS])
def test_fused_equals_unfused_in_fp32(ranks, bias, chunk):
    x, weight, b, target, slices = _problem(ranks, bias)
    want_loss, want = _unfused(x, weight, b, target, slices)
    loss, got = _fused(x, weight, b, target, slices, chunk)
    assert abs(loss.item() - want_loss.item()) < FP32
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert float((g - w).abs().max()) < FP32


def test_all_ignored_tokens_give_zero_loss_and_gradients():
    x, weight, _, target, slices = _problem(2, False)
    loss, got = _fused(x, weight, None, torch.full_like(target, -100), slices, 4)
    assert loss.item() == 0.0 and all(float(g.abs().max()) == 0.0 for g in got if g is not None)


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("chunk", [5, None])
def test_loss_over_logits_equals_unfused_in_fp32(ranks, chunk):
    """`vocab_parallel_cross_entropy` over one tensor holding every rank's columns (an emulated
    model's logits), per-token incoming gradients of both signs; as `_unfused` (FP32's sums)."""
    x, weight, _, target, slices = _problem(ranks, False)
    logits = (x @ weight.t()).requires_grad_()
    grad = torch.randn(TOKENS, generator=torch.Generator().manual_seed(5))
    got = vocab_parallel_cross_entropy(logits, target, [lo for lo, _ in slices], lambda parts: parts, columns=slices,
                                       chunk=chunk)
    got.backward(grad)
    ref = logits.detach().clone().requires_grad_()
    want = combine_loss_parts(torch.stack([local_loss_parts(ref[:, lo:hi], target, lo) for lo, hi in slices]),
                              target == -100)
    want.backward(grad)
    assert float((got - want).detach().abs().max()) < FP32 and float((logits.grad - ref.grad).abs().max()) < FP32


def _unfused_token_stats(x, weight, b, target, scale):
    """TRL's per-token figures of ``z = scale (x W^T + b)``, from the full logits (autograd)."""
    z = scale * F.linear(x, weight, b)
    logp = torch.log_softmax(z, dim=-1)
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    lsq = torch.logsumexp(2 * logp, dim=-1)
    top1 = z.argmax(-1) == target
    return picked, entropy, lsq, z.mean(-1), top1


@pytest.mark.parametrize("ranks", [1, 3])
def test_log_probs_equal_unfused_in_fp32(ranks):
    """`fused_linear_log_probs` (TRL's fused LM head's figures) over 1 and 3 vocabulary slices, a
    logit scale (a temperature), a bias, chunks of 5; the gradients of a loss of the log-probabilities
    and the entropies with per-token weights of both signs, recomputed in backward (FP32's sums)."""
    x, weight, b, target, slices = _problem(ranks, True)
    target = target.clamp(min=0)  # TRL passes the scored positions only
    g = torch.Generator().manual_seed(6)
    a, v = torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)
    xs = [x.clone().requires_grad_() for _ in slices]
    full_w, full_b = weight.clone().requires_grad_(), b.clone().requires_grad_()
    got = fused_linear_log_probs(xs, [full_w[lo:hi] for lo, hi in slices], target, [lo for lo, _ in slices],
                                 lambda parts: parts, vocab_size=VOCAB, dtype=torch.float32,
                                 biases=[full_b[lo:hi] for lo, hi in slices], logit_scale=1 / 0.7,
                                 wanted=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), chunk=5)
    ((got[0] * a).sum() + (got[1] * v).sum()).backward()
    rx, rw, rb = (t.clone().requires_grad_() for t in (x, weight, b))
    want = _unfused_token_stats(rx, rw, rb, target, 1 / 0.7)
    ((want[0] * a).sum() + (want[1] * v).sum()).backward()
    for mine, theirs in zip(got[:4], want[:4]):
        assert float((mine - theirs).abs().max()) < FP32
    assert torch.equal(got[4], want[4])
    for mine, theirs in zip((sum(t.grad for t in xs), full_w.grad, full_b.grad), (rx.grad, rw.grad, rb.grad)):
        assert float((mine - theirs).abs().max()) < FP32


def test_a_second_backward_raises_naming_the_fix():
    """The gradients computed in the forward are used and freed by the first backward; a second one
    through the same graph raises (the fix: logits='full'), instead of a TypeError."""
    x, weight, _, target, _ = _problem(1, False)
    x.requires_grad_()
    loss = fused_linear_cross_entropy([x], [weight.requires_grad_()], target, [0], lambda parts: parts, chunk=5)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*logits='full'"):
        loss.backward()
    assert SECOND_BACKWARD.count("\n") == 0


# fp16 at a vocabulary where the softmax entries (about 1/V) lie below fp16's smallest normal, 2**-14
BIG_VOCAB, TINY_HIDDEN, FEW_TOKENS = 2**16, 8, 10
FP16_UNIT = 2.0**-11
SCALER_GRAD = 2.0**16 / 8  # the loss's gradient under a GradScaler: its first scale over the mean's 8 tokens


def _gamma(terms: int, unit: float) -> float:
    """A sum of ``terms`` terms in any order is within gamma of the exact one, relative to the sum of their magnitudes."""
    return terms * unit / (1 - terms * unit)


def _big_vocab_problem():
    """Inputs, weights and bias on grids (integers up to 2, multiples of 1/8 up to 1) whose logits,
    sums of 9 terms below 17 in multiples of 1/8, are exact in fp16 and fp64 in any order: the
    reference sees the same logits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (FEW_TOKENS, TINY_HIDDEN), generator=g).double()
    weight = torch.randint(-8, 9, (BIG_VOCAB, TINY_HIDDEN), generator=g).double() / 8
    bias = torch.randint(-8, 9, (BIG_VOCAB,), generator=g).double() / 8
    target = torch.randperm(BIG_VOCAB, generator=g)[:FEW_TOKENS]  # distinct: no gradient row sums two targets
    target[::5] = -100  # 8 scored tokens
    return x, weight, bias, target


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's products: GEMMs with an fp32 output"))])
@pytest.mark.parametrize("precision", ["fp16_params", "fp16_autocast"])
def test_fp16_gradients_at_a_large_vocabulary_are_within_fp16_rounding_of_the_exact_ones(precision, device):
    """Under fp16 the gradients are what fp16 rounding of the scaled logit gradient gives, as the
    unfused head's backward (run after the GradScaler's scale) gives them: softmax entries near
    1/V = 2**-16 must not become fp16 subnormals before the scale arrives.

    Bound, per gradient entry, against the exact (fp64) one; ``magnitude``: the sum over its terms
    of |logit gradient| x |other factor|, ``count``: the sum of |other factor|. The logits are exact
    (`_big_vocab_problem`). The fp32 softmax: its log-sum-exp sums V positive terms (relative
    gamma_V, any order) and every other step (exp, log, subtractions of numbers below 2**5) adds at
    most 128 u32 to the exponent, so each entry is within e32 = 1.01 (gamma_V + 128 u32) relative.
    Its fp16 rounding once scaled by at least the loss's gradient (what the unfused backward
    rounds): u16 relative and half the subnormal spacing, 2**-25 / SCALER_GRAD, absolute. The
    products are exact in fp32 and summed there (gamma over the terms: 10 tokens for the weight and
    the bias, V for the input), the unscaling one fp32 rounding, the final fp16 parameter gradient one more
    (u16 relative, 2**-25 / SCALER_GRAD absolute)."""
    x, weight, bias, target = _big_vocab_problem()
    scored = target != -100
    onehot = torch.zeros(FEW_TOKENS, BIG_VOCAB, dtype=torch.float64)
    onehot[scored.nonzero().squeeze(1), target[scored]] = 1.0
    logits = x @ weight.t() + bias
    exact = (torch.softmax(logits, dim=-1) - onehot) * scored.unsqueeze(1)  # d loss / d logits, fp64
    want_x, want_w, want_b = exact @ weight, exact.t() @ x, exact.sum(0)
    want_loss = -(torch.log_softmax(logits, dim=-1) * onehot).sum()

    dtype = torch.float16 if precision == "fp16_params" else torch.float32
    xs, w, b = (t.to(device, dtype).requires_grad_() for t in (x, weight, bias))
    with torch.autocast(device, dtype=torch.float16, enabled=precision == "fp16_autocast"):
        loss = fused_linear_cross_entropy([xs], [w], target.to(device), [0], lambda parts: parts, biases=[b], chunk=4)
    (loss * SCALER_GRAD).backward()
    assert xs.grad.dtype == w.grad.dtype == b.grad.dtype == dtype

    e32 = 1.01 * (_gamma(BIG_VOCAB, FP32_UNIT) + 128 * FP32_UNIT)
    absolute = 2.0**-25 / SCALER_GRAD
    for got, want, terms, magnitude, count in (
        (xs.grad, want_x, BIG_VOCAB, exact.abs() @ weight.abs(), weight.abs().sum(0).expand(FEW_TOKENS, -1)),
        (w.grad, want_w, FEW_TOKENS, exact.abs().t() @ x.abs(), x.abs().sum(0).expand(BIG_VOCAB, -1)),
        (b.grad, want_b, FEW_TOKENS, exact.abs().sum(0), torch.full((BIG_VOCAB,), float(FEW_TOKENS))),
    ):
        relative = e32 + 2 * FP16_UNIT + _gamma(terms, FP32_UNIT) + FP32_UNIT
        bound = 1.01 * (relative * magnitude + absolute * count) + absolute
        error = (got.cpu().double() / SCALER_GRAD - want).abs()
        assert bool((error <= bound).all()), (terms, float((error / bound).max()))
    # the loss: 8 log-sum-exps each within e32 absolute, summed in fp32
    assert abs(loss.item() - want_loss.item()) <= 8 * e32 + _gamma(8, FP32_UNIT) * want_loss.item() * 1.01


def test_bf16_gradients_are_rounded_twice_as_the_unfused_ones():
    """bf16 parameters: the logits' gradient is rounded to bf16 once and each parameter gradient once,
    after the loss's gradient multiplied the fp32 sums, as the unfused head's backward rounds them;
    rounding the products, or the loss's gradient, before (issue 57) adds roundings.

    The loss's gradient 1 + 2**-8 is exact in fp32 and not in bf16 (it rounds to 1). The inputs lie
    on grids whose logits are exact in bf16 and fp64 (sums of 8 products below 2, multiples of 1/8
    below 16: 8 significant bits), and the products of the rounded logit gradient with them are
    exact in fp32 (8 + 4 bits), their sums within gamma u32 (negligible here). So the relative rms
    error against the exact (fp64) gradients is that of 2 roundings, at most u sqrt(2) / sqrt(3)
    with u = 2**-8 (tests/test_precision.py's count), and of 4 with the products and the
    loss's gradient rounded as well."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (512, 8), generator=g).double()
    weight = torch.randint(-8, 9, (1024, 8), generator=g).double() / 8
    target = torch.randint(0, 1024, (512,), generator=g)
    target[::4] = -100
    grad_loss = 1 + 2.0**-8
    scored = target != -100
    onehot = torch.zeros(512, 1024, dtype=torch.float64)
    onehot[scored.nonzero().squeeze(1), target[scored]] = 1.0
    exact = (torch.softmax(x @ weight.t(), dim=-1) - onehot) * scored.unsqueeze(1) * grad_loss
    xs, w = x.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    (fused_linear_cross_entropy([xs], [w], target, [0], lambda parts: parts, chunk=100) * grad_loss).backward()
    bound = BF16_UNIT * math.sqrt(2) / math.sqrt(3)
    for got, want in ((xs.grad, exact @ weight), (w.grad, exact.t() @ x)):
        assert got.dtype == torch.bfloat16
        assert float((got.double() - want).norm() / want.norm()) < bound


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op writes, and the largest fp32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.dtype == torch.float32:
                    self.largest_fp32 = max(self.largest_fp32, t.numel())
        return out


def test_no_tensor_of_every_token_by_the_vocabulary():
    """One chunk's logits at most, in forward and backward; the unfused path writes (tokens, V)."""
    tokens, vocab = 64, 1024  # wider than the weight (V x 16) and the inputs
    x, weight = torch.randn(tokens, HIDDEN, requires_grad=True), torch.randn(vocab, HIDDEN, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    fused, unfused = _Largest(), _Largest()
    with fused:
        fused_linear_cross_entropy([x], [weight], target, [0], lambda parts: parts, chunk=8).backward()
    with unfused:
        logits = x @ weight.t()
        combine_loss_parts(local_loss_parts(logits, target, 0)[None], target == -100).sum().backward()
    assert unfused.largest == tokens * vocab
    assert fused.largest <= max(8 * vocab, vocab * HIDDEN) < tokens * vocab  # a chunk's logits; the weight gradient


def test_the_loss_over_bf16_logits_writes_no_fp32_tensor_of_their_size():
    """Logits given (``logits="full"`` / ``"local"``): forward and backward hold fp32 copies of one
    chunk at a time; the logits' gradient is bf16, as autograd of the unfused loss writes it."""
    tokens, vocab = 64, 1024
    logits = torch.randn(tokens, vocab).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    seen = _Largest()
    with seen:
        vocab_parallel_cross_entropy(logits, target, [0], lambda parts: parts, chunk=8).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert seen.largest_fp32 <= 8 * vocab < tokens * vocab


def test_chunks_fit_the_byte_budget():
    assert chunk_tokens(4096, 151_936) * 151_936 * 4 <= CHUNK_BYTES  # Qwen2.5's vocabulary, tp=1
    assert chunk_tokens(16, 128) == 16  # one chunk
    assert chunk_tokens(10, 10, chunk_bytes=4 * 10 * 3) == 3  # 4 equal chunks of at most 3 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_compiled_chunk_arithmetic_equals_eager(dtype):
    """aot_eager runs the ops as written: the chunk kernels compiled compute what they compute eager,
    bit for bit; a second run compiles nothing more (fp16's gradient scale is a constant of the
    dtype, not a value guarded on)."""
    x, weight, b, target, slices = _problem(2, True)
    x, weight, b = x.to(dtype), weight.to(dtype), b.to(dtype)
    counter = CompileCounterWithBackend("aot_eager")
    kernels = ChunkKernels(counter)
    eager = _fused(x, weight, b, target, slices, 5)
    compiled = _fused(x, weight, b, target, slices, 5, kernels=kernels)
    assert torch.equal(eager[0], compiled[0])
    assert all(torch.equal(g, c) for g, c in zip(eager[1], compiled[1]))
    frames = counter.frame_count
    _fused(x, weight, b, target, slices, 5, kernels=kernels)
    assert counter.frame_count == frames > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 weight-gradient GEMM with an fp32 output is CUDA's")
def test_fused_equals_unfused_under_bf16_autocast_on_cuda():
    """bf16 autocast over fp32 weights, as the Trainer runs: 5 chunks of the fused head against the
    unfused head, loss and gradients.

    Bound: both runs round each logit once to bf16 from fp32 sums of the same products (their
    order differs: far below a bf16 unit), so a logit moves by at most u = 2**-8 relative, i.e.
    by u max|z| absolutely; the loss per token (log-sum-exp minus the target logit) moves by at
    most 2 u max|z|. A softmax entry moves by a relative 2 u max|z| at most; then each run rounds
    the gradient of the logits once more and the unfused run its products once more (u each):
    gradients within u (2 max|z| + 3) in relative rms."""
    x, weight, _, target, slices = _problem(1, False)
    x, weight, target = x.cuda(), weight.cuda(), target.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want_loss, want = _unfused(x, weight, None, target, slices)
        loss, got = _fused(x, weight, None, target, slices, 5)
        max_logit = float((x @ weight.t()).abs().max())
    u = 2.0**-8
    scored = int((target != -100).sum())
    assert abs(loss.item() - want_loss.item()) <= 2 * u * max_logit * scored
    for g, w in zip(got[:2], want[:2]):  # input, weight
        assert g.dtype == w.dtype == torch.float32
        assert float((g - w).norm() / w.norm()) < u * (2 * max_logit + 3)


# -- the model's forward -------------------------------------------------------------------------------

LAYOUTS = {"tp1": {}, "emulated2": {"tp": 2, "emulate": True}}


def _laid_out(ref, layout: str, mode: str):
    """A copy of ``ref`` with the head and loss: tp=1 (`install_head`, as every door at tp=1) or emulated tp=2."""
    model = copy.deepcopy(ref)
    if layout == "tp1":
        install_head(model, mode)
    else:
        taco_accel.parallelize(model, compression=None, logits=mode, **LAYOUTS[layout])
    model.taco_head.chunk = 5  # several chunks, the last one short
    return model


def _grad_diff(model, ref) -> float:
    return max(float((p.grad - ref.get_parameter(n).grad).abs().max()) for n, p in model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["none", "local", "full"])
def test_every_logits_mode_matches_the_plain_model(arch, layout, mode):
    ref = tiny_model(arch)
    ids, labels = lm_batch(ref.config.vocab_size)
    model = _laid_out(ref, layout, mode)
    with loss_paths() as paths:
        out = model(ids, labels=labels)
    want = ref(ids, labels=labels)
    out.loss.backward()
    want.loss.backward()
    assert paths == {"fused": int(mode == "none"), "log_probs": 0, "logits": int(mode != "none")}
    assert type(out) is type(want)
    assert abs(out.loss.item() - want.loss.item()) < MODEL_FP32 and _grad_diff(model, ref) < MODEL_FP32
    if mode == "none":
        assert out.logits is None and "logits" not in out  # nothing of the vocabulary's size was computed
    else:  # one process holds every rank's slice: full logits in both modes
        assert float((out.logits - want.logits).abs().max()) < MODEL_FP32
    with torch.no_grad():  # without labels: the full logits
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=MODEL_FP32, rtol=0)
        assert model(ids, labels=labels, return_dict=False)[0].item() == pytest.approx(want.loss.item(), abs=MODEL_FP32)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_forward_returns_what_transformers_returns(arch, layout):
    """The output class and fields of the class's forward: the cache, hidden states and attentions
    when asked, ``logits_to_keep``, ``return_dict=False`` (a tuple without the None fields),
    ``num_items_in_batch`` and ``shift_labels``; greedy generation gives the plain model's tokens."""
    ref = tiny_model(arch).eval()
    ref.set_attn_implementation("eager")  # attention weights to return
    ids, labels = lm_batch(ref.config.vocab_size)
    model = _laid_out(ref, layout, "none")
    with torch.no_grad():
        for kwargs in ({"use_cache": True, "output_hidden_states": True, "output_attentions": True},
                       {"logits_to_keep": 1}, {"labels": labels, "num_items_in_batch": torch.tensor(5)},
                       {"labels": labels, "shift_labels": labels}):
            out, want = model(ids, **kwargs), ref(ids, **kwargs)
            unfused = {"logits"} if "labels" in kwargs else set()  # mode "none": no logits where labels are given
            assert type(out) is type(want) and set(out.keys()) == set(want.keys()) - unfused
            for key in want.keys():
                if key in out and key != "past_key_values" and key != "cache":
                    for a, b in zip(tree_leaves(out[key]), tree_leaves(want[key])):
                        assert float((a - b).abs().max()) < MODEL_FP32, (kwargs, key)
        out, want = model(ids, labels=labels, return_dict=False), ref(ids, labels=labels, return_dict=False)
        assert isinstance(out, tuple) and len(out) == len(want) - 1  # the logits of mode "none" left out
        generated = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
        assert torch.equal(generated, ref.generate(ids[:1, :4], max_new_tokens=5, do_sample=False))


def _smoothed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """A user's own loss: label smoothing (issue 57's held-out case)."""
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None else shift_labels
    return F.cross_entropy(logits.float().flatten(0, 1), shift.flatten(), ignore_index=ignore_index, label_smoothing=0.1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["none", "local", "full"])
def test_a_loss_function_of_ones_own_is_honoured(layout, mode, caplog):
    """``model.loss_function`` set by the user (label smoothing) gets the full logits in every mode
    and layout, as transformers gives them: loss and gradients as one process (MODEL_FP32); a mode
    that would save the logits says once that it saves nothing for this model."""
    ref = tiny_model("qwen2")
    ref.loss_function = _smoothed
    ids, labels = lm_batch(ref.config.vocab_size)
    model = _laid_out(ref, layout, mode)
    with caplog.at_level(logging.WARNING, logger="taco_accel.models.loss"):
        out, again = model(ids, labels=labels), model(ids, labels=labels)
    want = ref(ids, labels=labels)
    out.loss.backward()
    want.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) < MODEL_FP32 and abs(again.loss.item() - out.loss.item()) == 0
    assert _grad_diff(model, ref) < MODEL_FP32
    assert float((out.logits - want.logits).abs().max()) < MODEL_FP32
    noted = [r for r in caplog.records if "loss_function is not transformers' default" in r.getMessage()]
    assert len(noted) == int(mode != "full")


def test_peft_wrappers_reach_the_head_and_loss():
    """A peft model (PeftModelForCausalLM -> LoraModel -> the causal LM's forward) of a model whose
    head and loss are installed: its training forward runs the fused loss, as the plain peft model's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ref = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model = copy.deepcopy(ref)
    install_head(model, "none")
    ids, labels = lm_batch(128)
    with loss_paths() as paths:
        out = model(input_ids=ids, labels=labels)
    want = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    want.loss.backward()
    assert paths["fused"] == 1 and out.logits is None
    assert abs(out.loss.item() - want.loss.item()) < MODEL_FP32
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and max(float((model.get_parameter(n).grad - ref.get_parameter(n).grad).abs().max()) for n in lora) < MODEL_FP32


TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
@pytest.mark.parametrize("order", ["trl_first", "taco_first"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trls_fused_lm_head_runs_vocab_parallel_as_trls_own(arch, order, layout):
    """TRL's fused LM head (``add_fused_lm_head``, temperature 0.7, every per-token figure) added
    before or after taco_accel's head: ``fused_lm_head=True`` runs taco_accel's chunked log-
    probabilities (over the vocabulary slices), and gives TRL's own outputs and gradients of a loss
    of the log-probabilities and entropies (MODEL_FP32)."""
    pytest.importorskip("trl", minversion="1.16")  # the dev extras' TRL (a GPU image may lack it)
    from trl.trainer.utils import add_fused_lm_head

    base = tiny_model(arch)
    ids, labels = lm_batch(base.config.vocab_size)
    ref = copy.deepcopy(base)
    add_fused_lm_head(ref, temperature=0.7, outputs=TRL_OUTPUTS)
    if order == "trl_first":
        add_fused_lm_head(base, temperature=0.7, outputs=TRL_OUTPUTS)
        model = _laid_out(base, layout, "full")
    else:
        model = _laid_out(base, layout, "full")
        add_fused_lm_head(model, temperature=0.7, outputs=TRL_OUTPUTS)
        install_head(model)  # what laying it out (prepare, taco_trainer) does again
    with loss_paths() as paths:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss + 0.3 * out.entropy.sum()).backward()
    (want.loss + 0.3 * want.entropy.sum()).backward()
    assert paths["log_probs"] == 1 and type(out) is type(want)
    for key in TRL_OUTPUTS[:4] + ("loss",):
        assert float((out[key] - want[key]).abs().max()) < MODEL_FP32, key
    assert torch.equal(out.is_top1, want.is_top1) and torch.equal(out.label_mask, want.label_mask)
    assert _grad_diff(model, ref) < MODEL_FP32
    with torch.no_grad():  # without the keyword: the model's own forward
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=MODEL_FP32, rtol=0)


def test_a_forward_taco_accel_cannot_reach_is_refused_when_laid_out():
    """A forward replaced on the model by a wrapper that hides what it wraps (here around TRL's fused
    head): laying the model out raises, naming the fix, rather than drop it or let TRL's head score
    this rank's vocabulary slice."""
    pytest.importorskip("trl", minversion="1.16")  # the dev extras' TRL (a GPU image may lack it)
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model("qwen2")
    add_fused_lm_head(model)
    fused = model.forward
    model.forward = lambda *args, **kwargs: fused(*args, **kwargs)  # hides what it wraps
    with pytest.raises(ValueError, match="forward is replaced on the model.*before wrapping its forward") as refused:
        taco_accel.parallelize(model, tp=2, emulate=True, compression=None)
    assert "\n" not in str(refused.value)


def test_compressed_emulated_head_sends_its_input_gradient_through_the_codec():
    """Compression on (emulated tp=2): the fused loss's input gradient leaves through the head's
    compressed site, as the unfused head's does; the loss, computed from the same forward messages,
    equals the unfused one to fp32 rounding."""
    ref = tiny_model("qwen2")
    ids, labels = lm_batch(ref.config.vocab_size)
    losses, calls = {}, {}
    for mode in ("local", "none"):
        model = taco_accel.parallelize(copy.deepcopy(ref), tp=2, emulate=True, logits=mode,
                                       compression=taco_accel.TacoConfig(group_size=32))
        comm.pop_comm_stats()
        loss = model(ids, labels=labels).loss
        loss.backward()
        losses[mode] = loss.item()
        calls[mode] = comm.pop_comm_stats()["lm_head/bwd"].compressed_calls
    assert calls == {"local": 1, "none": 1}
    assert abs(losses["none"] - losses["local"]) < MODEL_FP32


def test_logits_mode_is_validated():
    model = taco_accel.parallelize(tiny_model("qwen2"), compression=None)
    with pytest.raises(ValueError, match="'none': no logits when labels are given"):
        taco_accel.parallelize(tiny_model("qwen2"), compression=None, logits="fused")
    with pytest.raises(ValueError, match="logits='bogus'"):
        model.taco.logits = "bogus"
    model.taco_head.mode = "bogus"  # the head's own attribute: checked at the next forward
    with pytest.raises(ValueError, match="logits='bogus'"):
        model(torch.zeros(1, 4, dtype=torch.long))
