"""Fault injection: wrong inputs must raise a clear error, on every rank and at once, never
train silently on wrong numbers nor hang.

Sections: what `parallelize` takes; token ids and labels; the same model and batch on every
TP rank (gloo ranks); data files. Multi-rank cases catch the error on each rank and return
it, so that a test sees every rank's error (`run_ranks` alone stops at the first one), and
run under a launch timeout (FAST_S) well below the library's own collective timeout (10 minutes):
an error that came from a rank left waiting in a collective fails the launch instead of hanging
it, and the errors asserted are of their own kinds, not timeouts. No test measures a duration.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import taco_accel
from taco_accel.data import load_texts
from taco_accel.data.loader import load_records
from taco_accel.data.supervised import SFTBatches, tokenize_records
from taco_accel.models.checks import fingerprint, verify_same_model
from taco_accel.models.tiny import tiny_config, tiny_model

# a launch that takes longer waits in a collective somewhere: generous for a loaded machine's
# start-up, far below the 10-minute collective timeout an error path must not wait for
FAST_S = 180


def _error(call) -> dict:
    """``{"type", "message"}`` of what ``call()`` raised (type None if nothing)."""
    try:
        call()
        kind, message = None, ""
    except Exception as error:  # the test asserts on the type
        kind, message = type(error).__name__, str(error)
    return {"type": kind, "message": message}


# -- parallelize: what it takes (one process) ------------------------------------------------

@pytest.mark.parametrize("tp", [0, -2, 2.0, "2", True])
def test_bad_tp_names_the_valid_values(tp):
    with pytest.raises(ValueError, match=r"tp=.*one of \[1, 2, 4\], or None"):
        taco_accel.parallelize(tiny_model("qwen2"), tp=tp)
    with pytest.raises(ValueError, match=r"one of \[1, 2, 4\]$"):
        taco_accel.parallelize(tiny_model("qwen2"), tp=tp, emulate=True)


@pytest.mark.parametrize("name", ["sequence_parallel", "emulate", "verify"])
def test_flags_must_be_booleans(name):
    with pytest.raises(ValueError, match=rf"{name}='no': pass True or False"):
        taco_accel.parallelize(tiny_model("gpt2"), **{name: "no"})


def test_bad_device_mesh():
    with pytest.raises(ValueError, match="device_mesh=.*DeviceMesh"):
        taco_accel.parallelize(tiny_model("gpt2"), device_mesh=2)


def test_peft_models_say_to_parallelize_first():
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"peft model .*taco_accel.get_peft_model\(taco_accel.parallelize\(model\)"):
        taco_accel.parallelize(get_peft_model(tiny_model("qwen2"), lora))
    with pytest.raises(ValueError, match="peft model"):  # LoRA layers without the PeftModel wrapper
        taco_accel.parallelize(inject_adapter_in_model(lora, tiny_model("qwen2")))


class Linear8bitLt(nn.Linear):  # as bitsandbytes names it
    __module__ = "bitsandbytes.nn.modules"

    def forward(self, x):
        return super().forward(x)


def test_quantized_models_are_refused():
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match=r"quantized models \(quant_method='bitsandbytes'\).*without quantization"):
        taco_accel.parallelize(model)
    model = tiny_model("llama")
    model.model.layers[0].mlp.up_proj = Linear8bitLt(64, 128)
    with pytest.raises(ValueError, match=r"quantized .*up_proj is a bitsandbytes.nn.modules.Linear8bitLt"):
        taco_accel.parallelize(model)
    model = tiny_model("llama")
    model.model.layers[1].self_attn.o_proj.weight.data = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"quantized .*o_proj.weight has dtype torch.float8_e4m3fn"):
        taco_accel.parallelize(model)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class MarkedLinear(nn.Linear):
    """A subclass that changes nothing a parallel layer would lose."""


def test_unknown_linear_subclasses_are_refused():
    model = tiny_model("qwen3")
    model.model.layers[1].mlp.down_proj = ScaledLinear(128, 64)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj is a .*ScaledLinear, a subclass of Linear .* "
                                         r"lose its own forward"):
        taco_accel.parallelize(model)
    model = tiny_model("qwen3")
    model.model.layers[0].mlp.gate_proj = nn.Sequential(nn.Linear(64, 128))
    with pytest.raises(ValueError, match=r"gate_proj is a torch.nn.modules.container.Sequential.*plain .*Linear"):
        taco_accel.parallelize(model)
    model = tiny_model("qwen3")
    model.model.layers[0].mlp.up_proj = MarkedLinear(64, 128)
    taco_accel.parallelize(model)  # accepted: the same forward, no extra parameters


def test_wrapped_and_dtensor_models_are_refused():
    wrapper = type("DistributedDataParallel", (nn.Module,), {})()
    wrapper.module = tiny_model("gpt2")
    with pytest.raises(ValueError, match="parallelize the transformers model first, then wrap it"):
        taco_accel.parallelize(wrapper)


def test_tiny_config_refuses_unknown_fields_and_derives_head_dim():
    with pytest.raises(ValueError, match=r"no field \['num_kv_heads'\]"):
        tiny_config("llama", num_kv_heads=2)
    assert tiny_config("llama", hidden_size=48, num_attention_heads=12).head_dim == 4


# -- token ids and labels (one process) ------------------------------------------------------

@pytest.mark.parametrize("emulate", [False, True], ids=["tp1", "emulated_tp2"])
def test_ids_and_labels_outside_the_vocabulary_raise(emulate):
    model = taco_accel.parallelize(tiny_model("mistral"), tp=2 if emulate else None, compression=None, emulate=emulate)
    ids = torch.randint(0, 130, (2, 8), generator=torch.Generator().manual_seed(0))
    for bad in (130, -1):
        wrong = ids.clone()
        wrong[1, 4] = bad
        with pytest.raises(IndexError, match=rf"input id {bad} is out of range: the vocabulary has 130 tokens"):
            model(wrong)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored: fine
    model(ids, labels=labels).loss.backward()
    for bad in (130, 1000, -5):
        labels[1, 5] = bad
        message = rf"label {bad} is out of range: the vocabulary has 130 tokens, 0..129"  # tp=1 too: the same loss
        with pytest.raises(IndexError, match=message):
            model(ids, labels=labels)
    with pytest.raises(ValueError, match=r"labels of shape \[2, 7\] do not match the logits \[2, 8\]"):
        model(ids, labels=ids[:, :7])


def test_the_id_message_names_the_vocabulary():
    model = taco_accel.parallelize(tiny_model("qwen2"), compression=None)
    with pytest.raises(IndexError, match=r"input id 200 is out of range: the vocabulary has 128 tokens, 0..127"):
        model(torch.tensor([[1, 200, 3]]))


# -- the same model on every rank (fingerprint, one process) --------------------------------

def test_fingerprint_sees_values_layout_and_config():
    from taco_accel.models.checks import _first_difference

    same, other = fingerprint(tiny_model("llama")), fingerprint(tiny_model("llama", seed=1))
    assert same == fingerprint(tiny_model("llama"))
    assert _first_difference(same, other) == "the values of parameter model.embed_tokens.weight"
    model = tiny_model("llama")
    with torch.no_grad():
        weight = model.model.layers[1].mlp.up_proj.weight
        weight.copy_(weight.flip(0))  # the same values, rows in another order
    assert _first_difference(same, fingerprint(model)) == "the values of parameter model.layers.1.mlp.up_proj.weight"
    changed = fingerprint(tiny_model("llama", rms_norm_eps=1e-3))
    assert _first_difference(same, changed) == "config.rms_norm_eps (1e-06 vs 0.001)"
    with torch.device("meta"):
        meta = fingerprint(tiny_model("llama"))
    assert all(p[4] is None for p in meta["params"]) and [p[:4] for p in meta["params"]] == [p[:4] for p in same["params"]]


def test_one_process_has_nothing_to_compare():
    verify_same_model(tiny_model("gpt2", seed=3), None)


# -- the same model and batch on every TP rank (gloo) ----------------------------------------

def _rank_faults(folders: list[str]) -> dict:
    """Each case on 2 ranks: the error every rank got."""
    rank = dist.get_rank()
    out = {
        "seed": _error(lambda: taco_accel.parallelize(tiny_model("qwen2", seed=rank), compression=None)),
        "config": _error(lambda: taco_accel.parallelize(tiny_model("qwen2", rms_norm_eps=1e-5 * (1 + rank)),
                                                        compression=None)),
        "unverified": _error(lambda: taco_accel.parallelize(tiny_model("qwen2", seed=rank), compression=None,
                                                            verify=False)),
    }
    model = taco_accel.parallelize(tiny_model("mistral"), compression=None)
    ids = torch.randint(0, 130, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids)  # the first forward compares the batches
    high, low, label = ids.clone(), ids.clone(), ids.clone()
    high[0, 3], low[1, 0], label[1, 5] = 130, -3, 129 + 7  # 130 is in no rank's rows of a vocabulary of 130
    out["high_id"] = _error(lambda: model(high))
    out["negative_id"] = _error(lambda: model(low))
    out["label"] = _error(lambda: model(ids, labels=label))
    out["after"] = _error(lambda: model(ids, labels=ids).loss.backward())  # the group still works
    fresh = taco_accel.parallelize(tiny_model("mistral"), compression=None)
    mine = ids.clone()
    if rank == 1:
        mine[0, 0] = 999  # a batch of its own, with an id only this rank sees
    out["batch"] = _error(lambda: fresh(mine))
    out["checkpoint"] = _error(lambda: taco_accel.from_pretrained(folders[0], compression=None)(ids))
    out["checkpoints"] = _error(lambda: taco_accel.from_pretrained(folders[rank], compression=None))
    return out


@pytest.fixture(scope="module")
def rank_faults(tmp_path_factory):
    folders = []
    for index, eps in enumerate((1e-6, 1e-5)):
        folders.append(str(tmp_path_factory.mktemp(f"checkpoint{index}")))
        tiny_model("qwen2", rms_norm_eps=eps).save_pretrained(folders[-1])
    return run_ranks(_rank_faults, 2, folders, timeout=FAST_S)


def _on_every_rank(results: list, case: str, kind: str | None, *fragments: str) -> None:
    for rank, result in enumerate(results):
        got = result[case]
        assert got["type"] == kind, (rank, got)
        assert all(f in got["message"] for f in fragments), (rank, got)


def test_different_seeds_raise_on_every_rank(rank_faults):
    _on_every_rank(rank_faults, "seed", "ValueError", "the values of parameter model.embed_tokens.weight",
                   "between rank 0 and rank 1", "same seed", "verify=False")
    _on_every_rank(rank_faults, "unverified", None)


def test_different_configs_raise_on_every_rank(rank_faults):
    _on_every_rank(rank_faults, "config", "ValueError", "config.rms_norm_eps (1e-05 vs 2e-05)")


def test_ids_outside_the_vocabulary_raise_on_every_rank(rank_faults):
    _on_every_rank(rank_faults, "high_id", "IndexError", "input id 130 is out of range", "130 tokens")
    _on_every_rank(rank_faults, "negative_id", "IndexError", "input id -3 is out of range")
    _on_every_rank(rank_faults, "label", "IndexError", "label 136 is out of range")
    _on_every_rank(rank_faults, "after", None)


def test_different_batches_raise_on_every_rank(rank_faults):
    _on_every_rank(rank_faults, "batch", "ValueError", "got different input_ids", "ranks [1]", "data-parallel")


def test_from_pretrained_compares_configs_and_shapes(rank_faults):
    _on_every_rank(rank_faults, "checkpoint", None)  # meta parameters: no values to compare yet
    _on_every_rank(rank_faults, "checkpoints", "ValueError", "config.rms_norm_eps (1e-06 vs 1e-05)")


# -- data files -------------------------------------------------------------------------------

def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON"):
        load_texts(str(path))
    path.write_text('{"text": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: expected a JSON object"):
        load_records(str(path))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"text": "a"},\n {"text": }]')
    with pytest.raises(ValueError, match=rf"{broken}:2: not valid JSON"):
        load_records(str(broken))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"{binary}: not UTF-8"):
        load_records(str(binary))


def test_missing_text_field_names_line_and_keys(tmp_path):
    (tmp_path / "a.txt").write_text("a whole file")  # plain text: one document, whatever the field
    (tmp_path / "b.jsonl").write_text(json.dumps({"content": "x"}) + "\n\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'b.jsonl'}:3: no 'content' field .* fields \['body'\]"):
        load_texts(str(tmp_path), text_field="content")
    (tmp_path / "b.jsonl").write_text(json.dumps({"content": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1: the 'content' field is a list, not text"):
        load_texts(str(tmp_path), text_field="content")
    with pytest.raises(ValueError, match=r"no such file"):
        load_texts(str(tmp_path / "missing.jsonl"))


def test_supervised_records_name_file_and_line(tmp_path):
    from taco_accel.data import build_tokenizer

    tok = build_tokenizer("byte")
    rows = [
        {"prompt": "p", "response": "r"},
        {"prompt": "p", "response": None},  # would train on the text "None"
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        {"question": "q"},
    ]
    cases = [
        (1, r"the 'response' field is null"),
        (2, r"the last message is a 'user' turn"),
        (3, r"message 1 of 'messages' \(\['role'\]\) needs text 'role' and 'content'"),
        (4, r"cannot tell prompt and response apart in a record with fields \['question'\]: name them with --prompt-field"),
    ]
    for line, pattern in cases:
        path = tmp_path / f"case{line}.jsonl"
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[line]) + "\n")
        for fmt in ("plain", "chat"):
            with pytest.raises(ValueError, match=rf"{path}:2: {pattern}"):
                tokenize_records(load_records(str(path)), tok, fmt=fmt)
    with pytest.raises(ValueError, match="max_len=1"):
        tokenize_records([rows[0]], tok, max_len=1)
    with pytest.raises(ValueError, match="no examples"):
        SFTBatches([], 2, 1, pad_id=0)
    with pytest.raises(ValueError, match=r"dp_rank=1: pass an int in \[0, dp_size=1\)"):
        SFTBatches([([1, 2], [1, 2])], 2, 1, pad_id=0, dp_rank=1)


# -- checkpoints: changed settings on resume (killed saves, damaged and planted files: test_faults_io.py) --

def _resume_with_changed_settings(out: str, cache: str) -> dict:
    import logging

    from taco_accel.training import TrainConfig, Trainer

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("taco_accel").addHandler(handler)
    values = dict(family="qwen2", preset="nano", seq_len=32, micro_batch_size=2, micro_batches=1, steps=4, lr=1e-2,
                  warmup_steps=0, eval_every=0, trackers=(), progress=False, export=False, plot=False,
                  compression=None, output_dir=out, cache_dir=cache, device="cpu", tp=1, save_every=2)
    Trainer(TrainConfig(**values)).train(until=2)
    history = Trainer(TrainConfig(**{**values, "lr": 1e-3, "weight_decay": 0.0}, resume="latest")).train()
    return {"lrs": [r["lr"] for r in history], "log": "\n".join(records)}


def test_resume_applies_changed_hyper_parameters_and_says_so(tmp_path, token_cache):
    from taco_accel.training.trainer import TrainConfig, lr_lambda

    r = run_ranks(_resume_with_changed_settings, 1, str(tmp_path / "run"), token_cache)[0]
    factor = lr_lambda(TrainConfig(steps=4, warmup_steps=0))
    assert r["lrs"][:2] == pytest.approx([1e-2 * factor(0), 1e-2 * factor(1)])  # from the checkpoint's history
    assert r["lrs"][2:] == pytest.approx([1e-3 * factor(2), 1e-3 * factor(3)])  # the new peak, same schedule
    assert "lr 0.01 -> 0.001" in r["log"] and "weight_decay 0.1 -> 0.0" in r["log"]


# -- collectives: ranks that disagree, a stalled peer (gloo) -------------------------------------

DISAGREEMENTS = {  # case: what rank 1 does differently from rank 0, and the field the error must name
    "numel_same_padding": ({"numel": 1010}, "elements"),  # 1000 and 1010 values both pad to 8 groups of 128
    "dtype": ({"dtype": torch.bfloat16}, "dtype"),
    "group_size": ({"group_size": 64}, "group_size"),
    "format": ({"format": "e5m2"}, "format"),
    "random_signs": ({"random_signs": True}, "random_signs"),
    "scale_layout": ({"scales": "dual"}, "scales"),
    "plain_vs_compressed": ({"compress": False}, "compressed"),
}


def _disagreeing_calls() -> dict:
    out = {}
    rank = dist.get_rank()
    for case, (change, _) in DISAGREEMENTS.items():
        settings = dict(numel=1000, dtype=torch.float32, group_size=128, compress=None)
        if rank == 1:
            settings.update(change)
        numel, dtype, compress = settings.pop("numel"), settings.pop("dtype"), settings.pop("compress")
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
        out[case] = _error(lambda: taco_accel.all_reduce(x, config=taco_accel.TacoConfig(**settings), compress=compress,
                                                         site=f"case/{case}"))
    return out


@pytest.fixture(scope="module")
def disagreements():
    return run_ranks(_disagreeing_calls, 2, timeout=FAST_S)


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_disagree_about_a_collective_raise_on_every_rank(disagreements, case):
    field = DISAGREEMENTS[case][1]
    for rank in disagreements:
        r = rank[case]
        assert r["type"] == "CollectiveMismatch", r
        assert f"case/{case}" in r["message"] and field in r["message"], r["message"]


def _stalled_peer(released: str) -> dict:
    """Rank 1 stops answering after one good collective and comes back only once rank 0's next
    collective has failed (rank 0 writes ``released``), or after FAST_S: an order of events, not a
    duration. Rank 0 can only fail first by its group's own timeout."""
    import os

    from taco_accel.parallel import ParallelDims, build_mesh

    group = build_mesh(ParallelDims(tp=2), "cpu")["tp"].get_group()  # its timeout: TACO_TIMEOUT_S
    x, config = torch.ones(4096), taco_accel.TacoConfig()
    taco_accel.all_reduce(x, group, config, site="layers.0.mlp.down_proj/fwd")  # checked, and fine
    if dist.get_rank() == 1:  # a peer that stopped answering
        deadline = time.monotonic() + FAST_S
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"released": os.path.exists(released)}
    error = _error(lambda: taco_accel.all_reduce(x, group, config, site="layers.0.mlp.down_proj/fwd"))
    with open(released, "w"):
        pass
    return error


def test_a_stalled_peer_fails_the_collective_with_its_site_named(tmp_path):
    # the group's timeout: 3 s, not torch's 30 minutes nor the launch's FAST_S
    r, peer = run_ranks(_stalled_peer, 2, str(tmp_path / "released"), timeout=2 * FAST_S, env={"TACO_TIMEOUT_S": "3"})
    assert r["type"] == "CollectiveTimeout", r
    assert "layers.0.mlp.down_proj/fwd" in r["message"] and "TACO_TIMEOUT_S" in r["message"], r["message"]
    assert peer["released"]  # rank 0 failed while its peer still was not answering


def _shapes_at_a_later_step(mode: str) -> dict:
    """TP ranks fed batches of different shapes at a later step, where one rank's shape was agreed
    before and the other's is new: the new one is checked by its rank while the other rank goes on
    to the model's collectives (``mode``: "plain" or "compressed"). A group of its own, whose
    timeout is TACO_TIMEOUT_S."""
    from taco_accel.parallel import ParallelDims, build_mesh

    group = build_mesh(ParallelDims(tp=2), "cpu")["tp"].get_group()
    compression = None if mode == "plain" else taco_accel.TacoConfig(group_size=32)
    model = taco_accel.parallelize(tiny_model("qwen2"), compression=compression, device_mesh=group)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids)  # the first batch: compared, its shape agreed
    return _error(lambda: model(ids if dist.get_rank() == 0 else ids[:, :7]))


@pytest.mark.parametrize("mode", ["plain", "compressed"])
def test_ranks_fed_other_shapes_at_a_later_step_name_the_shapes_on_every_rank(mode):
    # the group's timeout: 3 s; the launch's FAST_S bounds the whole (no hang)
    for rank, got in enumerate(run_ranks(_shapes_at_a_later_step, 2, mode, timeout=FAST_S, env={"TACO_TIMEOUT_S": "3"})):
        assert got["type"] == "CollectiveMismatch", (rank, got)
        assert "the TP ranks got input_ids of different shapes ({0: [2, 8], 1: [2, 7]}" in got["message"], (rank, got)
        assert "same batch size and sequence length" in got["message"], (rank, got)
