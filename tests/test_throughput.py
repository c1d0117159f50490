"""The throughput bench (`taco_accel.bench.throughput`) on the CPU: the nano preset, one timed
step of a plain Accelerate loop, the same loop with liger-kernel and with cut-cross-entropy (Triton
kernels: skipped on the CPU, saying why, installed or not), with torch's own
``linear_cross_entropy`` (skipped before torch 2.13), the recipes' Trainer at tp=1 and emulated
tp=2 compressed, in one rank; the fused-loss bench's variants against its fp32 reference; the
host-sync counter both benches use (on the CPU, and on a GPU where there is one). The GPU figures
are in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from taco_accel.bench.syncs import HostSyncs

ROWS = ("plain", "liger", "cce", "torch_lce", "taco_tp1", "emulated_tp2_on")
NANO_HIDDEN, NANO_VOCAB = 32, 384
U32 = 2.0**-24  # fp32's unit roundoff
TRITON_ON_CPU = "kernels are Triton kernels for CUDA GPUs: no cpu row"


def _torch_lce() -> bool:
    return hasattr(torch.nn.functional, "linear_cross_entropy")


def _rows() -> tuple[list[dict], str]:
    from taco_accel.bench import throughput

    args = throughput.build_parser().parse_args(["--device", "cpu", "--preset", "nano", "--vocab", str(NANO_VOCAB),
                                                 "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "2",
                                                 "--warmup", "1", "--steps", "1"])
    results = [throughput.measure(row, args) for row in ROWS]
    return results, throughput.table(results, args)


def test_throughput_rows_on_the_cpu():
    results, text = run_ranks(_rows, 1)[0]
    rows = {r["row"]: r for r in results}
    measured = [r for r in results if "skipped" not in r]
    runs_here = [r for r in ROWS if r not in ("liger", "cce") and (r != "torch_lce" or _torch_lce())]
    assert [r["row"] for r in measured] == runs_here, results
    for r in measured:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["first_step_s"] > 0, r
        # no device memory or peak rate on the CPU
        assert r["mfu"] is None and r["peak_mem_gib"] is None and r["held_gib"] is None, r
        assert isinstance(r["host_syncs"], int) and r["host_syncs"] >= 0, r
        assert f"| {r['row']} |" in text
    # liger-kernel's and cut-cross-entropy's Triton kernels fail on CPU tensors: skipped, installed or not
    assert f"| liger | skipped: liger-kernel's {TRITON_ON_CPU}" in text
    assert f"| cce | skipped: cut-cross-entropy's {TRITON_ON_CPU}" in text
    if _torch_lce():
        # the same weights and batch as the plain row, the loss computed another way: each token's
        # loss is a length-h dot product (the logit) and a sum of V exponentials, each off by at most
        # n u relative in fp32 (gamma_n), in both computations; at initialisation the logits are
        # small and the loss ~ log V, so |lse| + |z_target| <= 2 |loss|
        plain, lce = rows["plain"]["first_loss"], rows["torch_lce"]["first_loss"]
        assert abs(lce - plain) <= 2 * (NANO_HIDDEN + NANO_VOCAB) * U32 * 2 * abs(plain), (lce, plain)
    else:
        assert "| torch_lce | skipped: torch " in text and "has no torch.nn.functional.linear_cross_entropy" in text
    # every row counts the same FLOPs per token: the same model and batch
    flops = {round(r["tflops"] * r["step_s"], 12) for r in measured}
    assert len(flops) == 1, results


def test_fused_loss_bench_against_its_reference_on_the_cpu():
    """The fused-loss bench's error columns: the unfused variant is its fp32 reference's own
    computation (error 0), ours and torch's own within fp32 rounding; the Triton libraries skip."""
    from taco_accel.bench import fused_loss

    hidden, vocab = 32, 512
    args = fused_loss.build_parser().parse_args(["--device", "cpu", "--tokens", "64", "--hidden", str(hidden),
                                                 "--vocab", str(vocab), "--warmup", "1", "--steps", "1"])
    rows = {v: fused_loss.measure(v, args) for v in ("unfused", "fused", "torch_lce", "cce", "liger")}
    unfused = rows["unfused"]
    assert unfused["loss_rel_err"] == unfused["grad_x_max_err"] == unfused["grad_w_max_err"] == 0, unfused
    # each loss and gradient entry is a length-h dot product and a sum over V (the log-sum-exp)
    # or over the tokens (the weight gradient, 64 <= V), off by at most n u relative (gamma_n) in
    # each of the two computations; the softmax's entries are <= 1 and the gradients' largest
    # entries of the order of the terms they sum
    bound = 2 * (hidden + vocab) * U32
    for v in ("fused", "torch_lce") if _torch_lce() else ("fused",):
        r = rows[v]
        assert r["host_syncs"] == 0, r  # none of them reads a value to the host
        assert r["loss_rel_err"] <= bound and r["grad_x_max_err"] <= bound and r["grad_w_max_err"] <= bound, r
    for v in ("cce", "liger"):
        assert TRITON_ON_CPU in rows[v]["skipped"], rows[v]
    assert f"| cce | skipped: cut-cross-entropy's {TRITON_ON_CPU}" in fused_loss.table(list(rows.values()), args)


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 if grad.sum().item() != 0 else grad  # one read, in the backward


def _count(device: str, fn) -> int:
    with HostSyncs(device) as syncs:
        fn()
    return syncs.count


def _sync_cases(device: str) -> dict[str, int]:
    x = torch.randn(64, device=device, requires_grad=True)
    return {
        "device work": _count(device, lambda: (x * 2).sum().backward()),
        ".item()": _count(device, lambda: x.sum().item()),
        "nonzero": _count(device, lambda: x.nonzero()),
        "boolean index": _count(device, lambda: x[x > 0]),
        "a read in backward": _count(device, lambda: _ReadsInBackward.apply(x).sum().backward()),
    }


def test_host_syncs_counts_each_wait_on_the_cpu():
    assert _sync_cases("cpu") == {"device work": 0, ".item()": 1, "nonzero": 1, "boolean index": 1,
                                  "a read in backward": 1}


def test_host_syncs_are_counted_as_a_cuda_step_pays_them():
    """On the CPU, tensors that exist when the block starts are device tensors unless named host;
    reading a host tensor is free; a pinned non-blocking copy is no sync, a blocking one is."""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    steps = torch.tensor(3.0)  # an optimizer's step count, kept on the host
    with HostSyncs("cpu", host=[steps]) as syncs:
        data = torch.tensor([[1.0, -2.0, 3.0, 4.0]])  # host data
        int((data > 0).sum())  # a host read: free
        steps.item()  # free
        x = data.to("cpu")  # to the device, blocking: 1
        y = (x @ weight).sum()
        y.backward()
        y.item()  # 2
        torch.stack([y.detach(), y.detach()]).tolist()  # 3
        torch.tensor([1.0], device="cpu")  # host data made on the device: 4
        torch.zeros(3, device="cpu").tolist()  # a device tensor read: 5
        weight.grad[weight.grad > 0]  # a value-sized op of a device tensor: 6
        data.to("cpu", non_blocking=True)  # pinned on CUDA: no sync
        torch.empty(0).to("cpu")  # nothing to copy
    kinds = [kind for kind, _ in syncs.events]
    assert kinds == ["to_device", "read", "to_host", "to_device", "to_host", "value_sized"], syncs.events
    assert all("tests/test_throughput.py:" in where for _, where in syncs.events), syncs.events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_host_syncs_counts_each_wait_on_a_gpu():
    cases = _sync_cases("cuda")
    x = torch.randn(64, device="cuda")
    cases["to the host"] = _count("cuda", lambda: x.to("cpu"))
    # a pageable host-to-device copy waits too (the plain loop's batch, a clip's host list)
    cases["pageable to the device"] = _count("cuda", lambda: torch.ones(4).to("cuda"))
    assert cases == {"device work": 0, ".item()": 1, "to the host": 1, "nonzero": 1, "boolean index": 1,
                     "a read in backward": 1, "pageable to the device": 1}


def test_a_failed_row_says_why():
    from taco_accel.bench.throughput import failure

    dynamo = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    torch.addmm(\n"
              "torch._dynamo.exc.Unsupported: addmm with out_dtype\n\n"
              "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
    assert failure(dynamo) == ["torch._dynamo.exc.Unsupported: addmm with out_dtype"]
    assert failure("killed\nno exception line\nat all\nhere") == ["no exception line", "at all", "here"]
