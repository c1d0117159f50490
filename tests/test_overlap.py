"""Compute/communication overlap in the TP layers (`taco_accel.tp.overlap`) on two gloo ranks.

The same model runs with ``model.taco.overlap`` on and off; with compression off the two agree to
fp32 rounding (the unfused path is itself checked against one process in test_parallelize.py,
which runs with overlap on by default); compressed, both within the codec's bound of the plain
run, with the same bytes per site. Counters prove that the fused paths ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks

import taco_accel
from taco_accel import comm
from taco_accel.tp import overlap
from taco_accel.models.tiny import tiny_model

ON = taco_accel.TacoConfig(threshold_bytes=0, group_size=32)
ARCHS = ("qwen3", "gpt2", "llama")


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


def _diff(a: dict, b: dict) -> dict:
    grads = max(float((a["grads"][n] - g).abs().max()) for n, g in b["grads"].items())
    return {"loss": float((a["loss"] - b["loss"]).abs()), "logits": float((a["logits"] - b["logits"]).abs().max()),
            "grads": grads}


def _worker() -> dict:
    counts = _counting()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 8), generator=g)
    labels = ids.clone()
    results = {}
    for arch in ARCHS:
        ref = tiny_model(arch)
        for sp in (False, True):
            for label, compression in (("off", "off"), ("on", ON)):
                model = taco_accel.parallelize(copy.deepcopy(ref), compression=compression, sequence_parallel=sp)
                before = dict(counts)
                fused = _run(model, ids, labels, True)
                ran = {k: counts[k] - before[k] for k in counts}
                unfused = _run(model, ids, labels, False)
                ran_off = {k: counts[k] - before[k] - ran[k] for k in counts}
                results[arch, sp, label] = {
                    "diff": _diff(fused, unfused), "ran": ran, "ran_off": ran_off,
                    "bytes": (fused["bytes"], unfused["bytes"]), "loss": float(fused["loss"]),
                    "plain_loss": None,
                }
            results[arch, sp, "on"]["plain_loss"] = results[arch, sp, "off"]["loss"]
    return results


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_overlap_equals_the_unfused_layers(measured, arch, sp):
    layers = 2
    for result in measured:
        off, on = result[arch, sp, "off"], result[arch, sp, "on"]
        # the fused paths ran: attention and MLP regions per layer, the lm head; rows under SP
        assert off["ran"] == {"column": 2 * layers + 1, "row": 2 * layers if sp else 0}, off["ran"]
        assert off["ran_off"] == {"column": 0, "row": 0}
        assert max(off["diff"].values()) < 1e-6, off["diff"]  # fp32 rounding
        # compressed: each within the codec's bound; the same sites, calls and bytes either way
        assert abs(on["loss"] - on["plain_loss"]) < 0.02 * on["plain_loss"], (on["loss"], on["plain_loss"])
        assert on["diff"]["loss"] < 0.02 * on["plain_loss"], on["diff"]
        fused, unfused = on["bytes"]
        assert fused == unfused, (fused, unfused)
        assert any(compressed for _, compressed, _ in fused.values())


def test_replicated_gradients_take_one_all_reduce(measured):
    for result in measured:
        for arch in ARCHS:  # under SP every norm's gradient is summed; Qwen3's q/k norms always
            for sp in (False, True):
                calls = result[arch, sp, "off"]["bytes"][0].get("replicated_params/grad", (0,))[0]
                assert calls == (1 if sp or arch == "qwen3" else 0), (arch, sp, calls)
