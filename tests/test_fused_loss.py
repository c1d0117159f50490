"""The fused vocab-parallel head and loss (`tp.fused_cross_entropy`, ``logits="none"``), in one process.

Against the unfused computation it replaces (the head's matmul, then `local_loss_parts` per
vocabulary slice and their combination, autograd for the gradients): the summed loss and every
gradient in fp32 over chunks that do not divide the tokens, with a bias, ignored tokens and a
vocabulary split over 1 to 3 ranks; the largest tensor it allocates (one chunk's logits, never
the (tokens, V/tp) ones); a model with ``logits="none"`` at tp=1 and emulated tp=2 (compression off
and on) against the plain transformers model; the chunk arithmetic compiled. Real TP over gloo
ranks is in tests/test_parallelize.py (fp32, every family, tp 2 and 4) and tests/test_precision.py
(bf16 autocast and parameters), the recipes' Trainer in tests/test_recipes.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import UNIT as FP32_UNIT
from harness import TINY_MODEL_FP32, fp32_bound, lm_batch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import taco_accel
from taco_accel import comm
from taco_accel.models.tiny import tiny_model
from taco_accel.tp.cross_entropy import combine_loss_parts, local_loss_parts
from taco_accel.tp.fused_cross_entropy import CHUNK_BYTES, ChunkKernels, chunk_tokens, fused_linear_cross_entropy

TOKENS, HIDDEN, VOCAB = 23, 16, 40
# fp32, any order: each logit a sum of HIDDEN products; the loss a sum over <= TOKENS tokens of
# log-sum-exps of O(1) logits over VOCAB entries; a gradient a sum of TOKENS (weight) or VOCAB
# (input) products: sums of at most 64 terms whose magnitudes add up to less than 100
FP32 = fp32_bound(64, 100.0)
# a tiny model fused against the plain one, as tests/test_parallelize.py bounds a parallel model
# against one process
MODEL_FP32 = TINY_MODEL_FP32


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


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op writes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
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


def test_chunks_fit_the_byte_budget():
    assert chunk_tokens(4096, 151_936) * 151_936 * 4 <= CHUNK_BYTES  # Qwen2.5's vocabulary, tp=1
    assert chunk_tokens(16, 128) == 16  # one chunk
    assert chunk_tokens(10, 10, chunk_bytes=4 * 10 * 3) == 3  # 4 equal chunks of at most 3 tokens


@pytest.mark.parametrize("arch, kwargs", [("qwen2", {}), ("gpt2", {"tp": 2, "emulate": True}),
                                          ("llama", {"tp": 2, "emulate": True})],
                         ids=["tp1-qwen2", "emulated2-gpt2", "emulated2-llama"])
def test_a_model_with_logits_none_matches_the_plain_model(arch, kwargs):
    ref = tiny_model(arch)
    ids, labels = lm_batch(ref.config.vocab_size)
    model = taco_accel.parallelize(copy.deepcopy(ref), compression=None, logits="none", **kwargs)
    model.taco.fused.chunk = 5  # several chunks, the last one short
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    out.loss.backward()
    want.loss.backward()
    assert out.logits is None and "logits" not in out  # nothing of the vocabulary's size was computed
    assert abs(out.loss.item() - want.loss.item()) < MODEL_FP32
    for name, p in model.named_parameters():
        assert float((p.grad - ref.get_parameter(name).grad).abs().max()) < MODEL_FP32, name
    with torch.no_grad():  # without labels: the full logits
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=MODEL_FP32, rtol=0)
        assert model(ids, labels=labels, return_dict=False)[0].item() == pytest.approx(want.loss.item(), abs=MODEL_FP32)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_compiled_chunk_arithmetic_equals_eager(dtype):
    """aot_eager runs the ops as written: the compiled gradient's pointwise form (exp, minus 1 where
    the column is the target, the scale) computes each entry as eager's in-place form does, so the
    loss and gradients are the same, bit for bit; a second run compiles nothing more (fp16's
    gradient scale is a constant of the dtype, not a value guarded on)."""
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


def test_logits_mode_none_is_validated():
    model = taco_accel.parallelize(tiny_model("qwen2"), compression=None)
    with pytest.raises(ValueError, match="'none': no logits when labels are given"):
        taco_accel.parallelize(tiny_model("qwen2"), compression=None, logits="fused")
    model.taco.logits = "bogus"
    with pytest.raises(ValueError, match="logits='bogus'"):
        model(torch.zeros(1, 4, dtype=torch.long))


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
