"""Compute/communication overlap in the TP layers (`taco_accel.tp.overlap`) on two gloo ranks.

The same model runs with ``model.taco.overlap`` on and off (the unfused path is itself checked
against one process in test_parallelize.py, which runs with overlap on by default).
Compression off, the two agree to fp32 rounding. Compressed, they need not agree that closely:
the fused backward adds a region's input gradients in its own order (and, with sequence
parallelism, multiplies row subsets), an fp32 rounding apart, which can flip the FP8 rounding
of a value in a compressed message. So the compressed backward is checked on one MLP block
with a fixed output gradient: on both paths the input gradient (what the compressed
all-reduce or reduce-scatter returns) within the codec's bound of the exact sum of the ranks'
partial gradients, the parameter gradients (upstream of that collective) to fp32 rounding, the
same bytes per site. Counters prove that the fused paths ran. One case per launch item
(`harness.per_case`).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from harness import UNIT, case, fp32_bound, per_case, run_ranks

import taco_accel
from taco_accel import comm
from taco_accel.models.tiny import tiny_model
from taco_accel.tp import overlap
from taco_accel.tp.layers import ColumnParallelLinear
from taco_accel.tp.mappings import blocks

ON = taco_accel.TacoConfig(group_size=32)
ARCHS = ("qwen3", "gpt2", "llama")
# The codec's worst case for one group, relative in L2 (tests/test_codec.py worst_case_error):
# E4M3 rounding to nearest moves a normal value by at most 2**-4 of itself, a subnormal by half a
# subnormal step (2**-10 of the scale) while the group's norm is at least 448 steps of it.
CODEC = 2.0**-4 + math.sqrt(ON.group_size) * 2.0**-10 / 448


def _counting() -> dict:
    """Count the fused autograd functions' forward calls (patched in this rank only)."""
    counts = {"column": 0, "row": 0}
    for key, fn in (("column", overlap._ColumnRegionFn), ("row", overlap.RowSequenceLinear)):
        original = fn.forward

        def forward(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        fn.forward = staticmethod(forward)
    return counts


COUNTS = None


def _run(model, ids, labels, enabled: bool) -> dict:
    model.taco.overlap.enabled = enabled
    comm.pop_comm_stats()
    model.zero_grad()
    out = model(ids, labels=labels)
    out.loss.backward()
    stats = comm.pop_comm_stats()
    return {
        "loss": out.loss.detach(), "logits": out.logits.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "bytes": {k: (v.calls, v.compressed_calls, v.bytes_sent) for k, v in stats.items()},
    }


def _fp32_excess(a: torch.Tensor, b: torch.Tensor, terms: int) -> float:
    """How far |a - b| exceeds the difference of two fp32 evaluations (any order) of sums of
    ``terms`` values: 2 gamma_terms sum|value|, the sum of magnitudes taken as max(|b|, 1) (the
    tiny models' activations, weights and gradients are O(1)); <= 0: within."""
    return float((a - b).abs().max()) - fp32_bound(terms, max(float(b.abs().max()), 1.0))


def _model_case(arch: str, sp: bool, label: str) -> dict:
    """The whole model with overlap on and off: fp32 differences (compression off) and bytes."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 8), generator=g)
    model = taco_accel.parallelize(tiny_model(arch), compression="off" if label == "off" else ON,
                                   sequence_parallel=sp)
    before = dict(COUNTS)
    fused = _run(model, ids, ids, True)
    ran = {k: COUNTS[k] - before[k] for k in COUNTS}
    unfused = _run(model, ids, ids, False)
    ran_off = {k: COUNTS[k] - before[k] - ran[k] for k in COUNTS}
    terms = 2 * 8 * 128  # the longest sums: a weight gradient over 16 tokens, of products of 128-long rows
    excess = max(_fp32_excess(fused[k], unfused[k], terms) for k in ("loss", "logits"))
    excess = max([excess] + [_fp32_excess(fused["grads"][n], v, terms) for n, v in unfused["grads"].items()])
    return {"ran": ran, "ran_off": ran_off, "excess": excess, "bytes": (fused["bytes"], unfused["bytes"])}


def _mlp_case(arch: str, sp: bool) -> dict:
    """Layer 1's MLP (a column region entered by its hidden states, a row layer leaving it),
    compressed, fed a fixed input and output gradient, with overlap on and off."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = taco_accel.parallelize(tiny_model(arch), compression=ON, sequence_parallel=sp)
    model.taco.sequence.active = sp  # as in a forward of the whole model
    mlp = (model.transformer.h if arch == "gpt2" else model.model.layers)[1].mlp
    gen = torch.Generator().manual_seed(5)  # the same on every rank
    x, grad_out = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    if sp:  # this rank's sequence-parallel block (the r-th 1/tp of the token rows), in and out
        x, grad_out = blocks(x, world, 1)[rank], blocks(grad_out, world, 1)[rank]
    columns = [m for m in mlp.modules() if isinstance(m, ColumnParallelLinear)]
    runs = {}
    for fused in (True, False):
        model.taco.overlap.enabled = fused
        mlp.zero_grad()
        gys = {}  # column layer -> the gradient of its output

        def keep(module, args, y, gys=gys) -> None:
            y.register_hook(lambda grad: gys.__setitem__(module, grad))

        hooks = [c.register_forward_hook(keep) for c in columns]
        before = dict(COUNTS)
        comm.pop_comm_stats()
        xin = x.clone().requires_grad_()
        mlp(xin).backward(grad_out)
        for h in hooks:
            h.remove()
        runs[fused] = {"grad_x": xin.grad, "grads": {n: p.grad.clone() for n, p in mlp.named_parameters()},
                       "gys": gys, "ran": sum(COUNTS[k] - before[k] for k in COUNTS),
                       "bytes": {k: (v.calls, v.compressed_calls, v.bytes_sent)
                                 for k, v in comm.pop_comm_stats().items()}}
    # the exact input gradient: every rank's partial sum over its column layers' gradients (unfused
    # run, where the layers see their output gradients), in float64, summed over the ranks
    partial = sum((gy.double() @ (c.weight.double().t() if c.conv1d else c.weight.double())
                   for c, gy in runs[False]["gys"].items()), torch.zeros(()))
    partials = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(partials, partial)
    if sp:  # the reduce-scatter returns this rank's rows of the sum
        partials = [blocks(p, world, 1)[rank] for p in partials]
    exact = sum(partials)
    # two-shot: each rank's chunk encoded (CODEC of its norm), summed, the sum encoded again
    # (CODEC of its norm, itself within CODEC * sum |partial| of the exact one), decoded in fp32;
    # over all groups by Minkowski's inequality, the same bound holds for the whole tensor
    parts = sum(float(p.norm()) for p in partials)
    bound = CODEC * parts + CODEC * (float(exact.norm()) + CODEC * parts) + 64 * UNIT * parts
    out = {"ran": runs[True]["ran"], "ran_off": runs[False]["ran"],
           "bytes": (runs[True]["bytes"], runs[False]["bytes"]),
           "grad_x_error": [float((runs[f]["grad_x"].double() - exact).norm()) / bound for f in (True, False)]}
    # the parameter gradients come from the fixed output gradient (a sequence all-gather of the
    # same bytes under SP): fp32 sums over 16 tokens and 128-long rows, in two orders
    out["param_excess"] = max(_fp32_excess(runs[True]["grads"][n], g, 2 * 8 * 128)
                              for n, g in runs[False]["grads"].items())
    return out


def _worker() -> dict:
    global COUNTS
    COUNTS = _counting()
    cases = {}
    for arch in ARCHS:
        for sp in (False, True):
            for label in ("off", "on"):
                cases[arch, sp, label] = functools.partial(_model_case, arch, sp, label)
            cases[arch, sp, "mlp"] = functools.partial(_mlp_case, arch, sp)
    return per_case(cases)


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_overlap_equals_the_unfused_layers(measured, arch, sp):
    layers = 2
    for off, on in zip(case(measured, (arch, sp, "off")), case(measured, (arch, sp, "on"))):
        # the fused paths ran: attention and MLP regions per layer, the lm head; rows under SP
        assert off["ran"] == {"column": 2 * layers + 1, "row": 2 * layers if sp else 0}, off["ran"]
        assert off["ran_off"] == {"column": 0, "row": 0}
        assert off["excess"] <= 0, off["excess"]  # loss, logits and every gradient: fp32 rounding
        # compressed: the same sites, calls and bytes either way, and compressed
        fused, unfused = on["bytes"]
        assert fused == unfused, (fused, unfused)
        assert any(compressed for _, compressed, _ in fused.values())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_compressed_backward_of_the_fused_layers_within_the_codec_bound(measured, arch, sp):
    for r in case(measured, (arch, sp, "mlp")):
        assert r["ran"] > 0 and r["ran_off"] == 0, r  # fused, then unfused
        assert max(r["grad_x_error"]) <= 1, r["grad_x_error"]  # fused, unfused: each / the codec's bound
        assert r["param_excess"] <= 0, r["param_excess"]
        fused, unfused = r["bytes"]
        assert fused == unfused and any(compressed for _, compressed, _ in fused.values()), r["bytes"]


def test_replicated_gradients_take_one_all_reduce(measured):
    for arch in ARCHS:  # under SP every norm's gradient is summed; Qwen3's q/k norms always
        for sp in (False, True):
            for r in case(measured, (arch, sp, "off")):
                calls = r["bytes"][0].get("replicated_params/grad", (0,))[0]
                assert calls == (1 if sp or arch == "qwen3" else 0), (arch, sp, calls)
