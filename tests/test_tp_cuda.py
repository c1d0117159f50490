"""Tensor parallelism on a GPU: bf16 weights, the fused Triton codec, two gloo ranks on one device.

Skipped without CUDA. NCCL refuses two ranks on one GPU, gloo does not, so this runs on the
one-GPU box too; it checks the CUDA path of the TP layers and codec, not NCCL speed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks

import taco_accel
from taco_accel.models.tiny import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _worker() -> dict:
    torch.cuda.set_device(0)
    out = {}
    for arch in ("qwen3", "gpt2"):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
        ref = tiny_model(arch).cuda().to(torch.bfloat16)
        plain = taco_accel.parallelize(copy.deepcopy(ref), compression=None, sequence_parallel=True)
        packed = taco_accel.parallelize(
            copy.deepcopy(ref), compression=taco_accel.TacoConfig(group_size=64),
            sequence_parallel=True,
        )
        losses = {}
        for name, model in (("ref", ref), ("plain", plain), ("compressed", packed)):
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses[name] = loss.item()
        with torch.no_grad():
            generated = packed.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out[arch] = {**losses, "generated": generated.shape[1], "device": str(packed.lm_head.weight.device)}
    return out


def _autocast_worker() -> dict:
    """fp32 weights under CUDA bf16 autocast, against the same model on one process under it
    (tests/test_precision.py's comparison, on the GPU: cuBLAS bf16 products)."""
    from test_precision import _bound, _grads_rel_rms, _rel_rms, _step

    torch.cuda.set_device(0)
    out = {}
    for arch in ("qwen3", "gpt2"):
        for sp in (False, True):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
            ref = tiny_model(arch).cuda()
            model = taco_accel.parallelize(copy.deepcopy(ref), compression=None, sequence_parallel=sp)
            got, want = (_step(m, ids, ids, torch.bfloat16, torch.bfloat16) for m in (model, ref))
            out[arch, sp] = {"logits": _rel_rms(got["logits"], want["logits"]), "grads": _grads_rel_rms(model, ref),
                             "logits_bound": _bound(torch.bfloat16, got["n_fwd"], want["n_fwd"]),
                             "grads_bound": _bound(torch.bfloat16, got["n_all"], want["n_all"]),
                             "dtype": str(got["logits"].dtype), "device": str(got["logits"].device)}
    return out


def test_cuda_bf16_autocast_matches_one_process():
    for result in run_ranks(_autocast_worker, 2):
        for key, r in result.items():
            assert r["device"].startswith("cuda") and r["dtype"] == "torch.bfloat16", (key, r)
            # relative rms within test_precision's rounding bound, u (sqrt N_a + sqrt N_b) / sqrt 3
            assert r["logits"] < r["logits_bound"] and r["grads"] < r["grads_bound"], (key, r)


def test_bf16_triton_codec_on_cuda():
    for result in run_ranks(_worker, 2):
        for arch, r in result.items():
            assert r["device"].startswith("cuda"), r
            assert abs(r["plain"] - r["ref"]) / r["ref"] < 1e-2, (arch, r)  # bf16 rounding
            assert abs(r["compressed"] - r["ref"]) / r["ref"] < 2e-2, (arch, r)
            assert r["generated"] == 8
