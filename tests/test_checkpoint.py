"""TP checkpoints: `save_pretrained` writes plain transformers checkpoints, `from_pretrained`
reads only the local slices of any transformers checkpoint. One 2-rank launch, every family."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from harness import TINY_MODEL_FP32, case, per_case, run_ranks

import taco_accel
from taco_accel.models.state import gather_state_dict, shard_specs
from taco_accel.models.tiny import tiny_model, tiny_model_types

ARCHS = tuple(tiny_model_types())  # every registered family: one parity suite


def _ids(vocab: int):
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(3))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _grad_diff(model, ref) -> float:
    rank, specs, worst = model.taco.rank, shard_specs(model), 0.0
    for name, param in model.named_parameters():
        expected = ref.get_parameter(name).grad
        expected = specs[name].take(expected, rank) if name in specs else expected
        worst = max(worst, _diff(param.grad, expected))
    return worst


def _round_trip(arch: str, root: str) -> dict:
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    model = taco_accel.parallelize(tiny_model(arch), compression=None)
    ids = _ids(model.config.vocab_size)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # weights no longer those of the seed
    expected = _logits(model, ids)
    path = os.path.join(root, f"{arch}-taco")
    taco_accel.save_pretrained(model, path)
    out = {"files": sorted(os.listdir(path))}
    if rank == 0:  # a plain transformers load, one process
        plain = AutoModelForCausalLM.from_pretrained(path)
        out["plain"] = _diff(plain(ids).logits.detach(), expected)
    for tp in (2, 1):
        loaded = taco_accel.from_pretrained(path, tp=tp, compression=None)
        out[f"taco_tp{tp}"] = _diff(_logits(loaded, ids), expected)
    state = gather_state_dict(taco_accel.from_pretrained(path, compression=None))
    saved = gather_state_dict(model)
    out["state_dict"] = max(_diff(state[k], saved[k]) for k in saved)
    out["keys_equal"] = sorted(state) == sorted(saved)
    return out


def _from_hf(arch: str, root: str) -> dict:
    """A checkpoint written by transformers itself; train on it with sequence parallelism."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, f"{arch}-hf")
    if dist.get_rank() == 0:
        tiny_model(arch, seed=5).save_pretrained(path)
    dist.barrier()
    ref = AutoModelForCausalLM.from_pretrained(path)
    model = taco_accel.from_pretrained(path, compression=None, sequence_parallel=True)
    model.train(), ref.train()
    ids = _ids(ref.config.vocab_size)
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    local_shapes_ok = all(
        model.get_parameter(n).shape[s.dim] == s.size(model.taco.rank) for n, s in shard_specs(model).items()
    )
    half = taco_accel.from_pretrained(path, compression=None, dtype=torch.bfloat16)
    return {
        "loss": abs(loss.item() - ref_loss.item()),
        "grad": _grad_diff(model, ref),
        "local_shapes_ok": local_shapes_ok,
        "training_mode_after_load": half.training,
        "bf16": {p.dtype for p in half.parameters()} == {torch.bfloat16},
    }


def _worker(root: str) -> dict:
    cases = {}
    for arch in ARCHS:
        cases[arch, "round_trip"] = functools.partial(_round_trip, arch, root)
        cases[arch, "from_hf"] = functools.partial(_from_hf, arch, root)
    return per_case(cases)


# a loaded model against the one it came from, the same weights, its sums split over other ranks
FP32 = TINY_MODEL_FP32


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("arch", ARCHS)
def test_save_is_a_plain_transformers_checkpoint(measured, arch):
    r = case(measured, (arch, "round_trip"))[0]
    assert "model.safetensors" in r["files"] and "config.json" in r["files"]
    assert r["plain"] < FP32, r


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_at_any_tp(measured, arch):
    for r in case(measured, (arch, "round_trip")):
        assert r["taco_tp2"] < FP32 and r["taco_tp1"] < FP32, r
        assert r["keys_equal"] and r["state_dict"] == 0.0, r


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_reads_transformers_checkpoints_and_trains(measured, arch):
    for r in case(measured, (arch, "from_hf")):
        assert r["loss"] < FP32 and r["grad"] < FP32, r
        assert r["local_shapes_ok"] and r["bf16"] and not r["training_mode_after_load"], r


def test_single_process_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    model = taco_accel.parallelize(tiny_model("gpt2"))
    taco_accel.save_pretrained(model, tmp_path)
    ids = _ids(130)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = taco_accel.from_pretrained(tmp_path)
    assert torch.equal(_logits(plain, ids), _logits(model, ids))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
