"""peft LoRA on tensor-parallel layers against plain peft on one process.

One 2-rank launch measures everything (every family at tp=2: loss, adapter gradients and the
initial adapter against peft on the unparallelised model; sequence parallelism; TACO
compression; the adapter and merged exports loaded by plain peft / transformers on one
process; the adapter loaded back into a TP model); the tests assert on what it returns.
Misuse (unsupported LoRA options, targets that are not parallel linears) is checked on one process.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from harness import TINY_MODEL_FP32, case, per_case, refusals, run_ranks

import taco_accel
from taco_accel.models.state import shard_specs
from taco_accel.models.tiny import tiny_model

ARCHS = ("qwen2", "llama", "gpt2", "qwen3")  # tied + GQA, one kv head replicated, fused Conv1D, q/k norms
COMPRESSED = taco_accel.TacoConfig()  # tiny tensors compress too
SEED = 7


def _lora_config(**overrides):
    from peft import LoraConfig

    values = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)
    return LoraConfig(**{**values, **overrides})


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt: no loss there
    return ids, labels


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _reference(path: str):
    """Plain peft on the unparallelised checkpoint: loss and adapter gradients of one batch."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path), _lora_config())
    ids, labels = _batch(ref.config.vocab_size)
    out = ref(ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    weights = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    return out.loss.item(), grads, weights


def _tp_lora(path: str, compression=None, sequence_parallel: bool = False):
    torch.manual_seed(SEED + dist.get_rank())  # different RNG states: the broadcast keeps A, B consistent
    if dist.get_rank() == 0:
        torch.manual_seed(SEED)
    model = taco_accel.from_pretrained(path, compression=compression, sequence_parallel=sequence_parallel)
    model.train()
    return taco_accel.get_peft_model(model, _lora_config())


def _against_reference(path: str, compression=None, sequence_parallel: bool = False) -> dict:
    """Loss and each adapter gradient (this rank's slices) vs. peft on one process."""
    ref_loss, ref_grads, ref_weights = _reference(path)
    model = _tp_lora(path, compression, sequence_parallel)
    ids, labels = _batch(model.config.vocab_size)
    loss = model(ids, labels=labels).loss
    loss.backward()
    rank, specs = model.taco.rank, shard_specs(model)
    grad, rel, init, names, diff_sq, ref_sq = 0.0, 0.0, 0.0, [], 0.0, 0.0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        names.append(name)
        expected, weight = ref_grads[name], ref_weights[name]
        if name in specs:
            expected, weight = specs[name].take(expected, rank), specs[name].take(weight, rank)
        grad, rel = max(grad, _diff(param.grad, expected)), max(rel, _rel(param.grad, expected))
        diff_sq += float((param.grad.double() - expected.double()).pow(2).sum())
        ref_sq += float(expected.double().pow(2).sum())
        init = max(init, _diff(param, weight))
    return {
        "loss": abs(loss.item() - ref_loss), "loss_rel": abs(loss.item() - ref_loss) / ref_loss,
        "grad": grad, "grad_rel": rel, "grad_rel_all": (diff_sq / ref_sq) ** 0.5, "init": init,
        "same_names": sorted(names) == sorted(ref_grads),
        "sharded": sum(n in specs for n in names), "trainable": len(names),
    }


def _exports(path: str, root: str) -> dict:
    """Train one step, then: the adapter in peft on one process, load_adapter into TP, the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    model = _tp_lora(path)
    ids, labels = _batch(model.config.vocab_size)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(ids, labels=labels).loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        expected = model(ids).logits  # full logits: no labels
    adapter, merged = os.path.join(root, "adapter"), os.path.join(root, "merged")
    model.save_pretrained(adapter)  # gathers: the same as taco_accel.save_adapter
    out = {"adapter_files": sorted(os.listdir(adapter))}
    if rank == 0:
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter)
        with torch.no_grad():
            out["peft_logits"] = _diff(plain(ids).logits, expected)
    reloaded = taco_accel.load_adapter(taco_accel.from_pretrained(path, compression=None), adapter)
    with torch.no_grad():
        out["load_adapter_logits"] = _diff(reloaded(ids).logits, expected)
    out["refused"] = refusals({"unknown": lambda: taco_accel.load_adapter(reloaded, adapter, adapter_name="x")})
    merged_model = taco_accel.export_merged(model, merged)
    with torch.no_grad():
        out["merged_tp_logits"] = _diff(merged_model(ids).logits, expected)
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(merged)
        with torch.no_grad():
            out["merged_logits"] = _diff(plain(ids).logits, expected)
        original = AutoModelForCausalLM.from_pretrained(path)
        out["merged_keys"] = sorted(plain.state_dict()) == sorted(original.state_dict())
    return out


def _worker(folders: dict, root: str) -> dict:
    cases = {}
    for arch, path in folders.items():
        cases[arch, "exact"] = functools.partial(_against_reference, path)
        cases[arch, "exports"] = functools.partial(_exports, path, os.path.join(root, arch))
    cases["qwen3", "sequence_parallel"] = functools.partial(_against_reference, folders["qwen3"], sequence_parallel=True)
    cases["qwen2", "compressed"] = functools.partial(_against_reference, folders["qwen2"], compression=COMPRESSED)
    cases["gpt2", "compressed"] = functools.partial(_against_reference, folders["gpt2"], compression=COMPRESSED,
                                                    sequence_parallel=True)
    return per_case(cases)


# TP LoRA against peft on one process, compression off: sums split over the ranks
FP32 = TINY_MODEL_FP32


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    folders = {}
    for arch in ARCHS:
        folders[arch] = str(root / f"{arch}-base")
        tiny_model(arch, seed=3).save_pretrained(folders[arch])
    return run_ranks(_worker, 2, folders, str(root))


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_lora_equals_peft_on_one_process(measured, arch):
    for m in case(measured, (arch, "exact")):
        assert m["same_names"] and m["sharded"] > 0, m
        assert m["init"] == 0.0, m  # the same adapter as peft draws from the same seed
        assert m["loss"] < FP32 and m["grad"] < FP32, m


def test_tp_lora_with_sequence_parallelism(measured):
    for m in case(measured, ("qwen3", "sequence_parallel")):
        assert m["loss"] < FP32 and m["grad"] < FP32, m


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_tp_lora_compressed_is_close(measured, arch):
    for m in case(measured, (arch, "compressed")):
        # FP8 on every TP collective: ~0.05% on the loss, ~10% on the (small) adapter gradients
        # of a random tiny model, about twice the full model's gradient error in the same setting
        assert m["init"] == 0.0 and m["loss_rel"] < 5e-3 and m["grad_rel_all"] < 0.25, m


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_and_merged_exports_load_in_plain_peft_and_transformers(measured, arch):
    ranks = case(measured, (arch, "exports"))
    first = ranks[0]
    assert "adapter_model.safetensors" in first["adapter_files"] and "adapter_config.json" in first["adapter_files"]
    # merged weights W + s B A, each rounded to fp32 once more (relative 2**-24), then the same
    # products: the same bound as the unmerged sums
    merged = FP32
    assert first["peft_logits"] < merged and first["merged_logits"] < merged and first["merged_keys"], first
    for m in ranks:
        assert m["load_adapter_logits"] < FP32 and m["merged_tp_logits"] < merged, m
        # an adapter name the peft model does not have loads nothing: refused, naming the ones it has
        assert "no adapter 'x'" in m["refused"]["unknown"] and "['default']" in m["refused"]["unknown"], m


# -- misuse, one process (tp=1) -----------------------------------------------------------

def _tiny_tp(arch: str = "qwen3"):
    return taco_accel.parallelize(tiny_model(arch), tp=1, compression=None)


@pytest.mark.parametrize("overrides, match", [
    (dict(use_dora=True), "use_dora"),
    (dict(init_lora_weights="pissa"), "init_lora_weights"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias"),
    (dict(target_modules=["lm_head"]), "lm head"),
    (dict(target_modules=["q_norm"]), "not column / row parallel"),
    (dict(target_modules=["nothing_here"]), "matches no module"),
])
def test_unsupported_lora_options_say_what_to_use(overrides, match):
    with pytest.raises(ValueError, match=match):
        taco_accel.get_peft_model(_tiny_tp(), _lora_config(**overrides))


def test_lora_needs_a_parallel_model_and_plain_peft_is_refused():
    import peft

    with pytest.raises(ValueError, match="parallelize"):
        taco_accel.get_peft_model(tiny_model("qwen2"), _lora_config())
    with pytest.raises(ValueError, match="not supported"):  # never silently skips the TP collectives
        peft.get_peft_model(_tiny_tp("qwen2"), _lora_config(target_modules=["q_proj"]))


def test_default_targets_and_all_linear():
    model = taco_accel.get_peft_model(_tiny_tp("qwen2"), _lora_config(target_modules=None))
    assert sorted(model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]  # peft's default
    model = taco_accel.get_peft_model(_tiny_tp("gpt2"), _lora_config())
    config = model.peft_config["default"]
    assert sorted(config.target_modules) == ["c_attn", "c_fc", "c_proj"] and config.fan_in_fan_out
    ledger = model.get_base_model().taco.sites.ledger  # the adapters' gradient sums count in the model's own
    sites = [m._tp_grad_site for m in model.modules() if hasattr(m, "_tp_grad_site")]
    assert len(sites) == 8 and all(s.record is ledger.record(s.name) for s in sites)  # 2 layers x 4
