"""Fine-tuning: response-only data, the local perplexity metric, the loop at tp=2 / dp=2 against one
process, and the recipes end to end through ``accelerate launch`` from a checkpoint folder."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from doc_commands import documented
from harness import run_command, run_ranks

from taco_accel.data import build_tokenizer
from taco_accel.data.supervised import IGNORE, CHATML, RecordFields, SFTBatches, collate, tokenize_records

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "recipes" / "data" / "sft_sample.jsonl"
CHAT = ROOT / "recipes" / "data" / "chat_sample.jsonl"


def _text(tok, ids) -> str:
    return tok.decode([i for i in ids if i != IGNORE])


# -- data -----------------------------------------------------------------------------------

def test_loss_only_on_the_response_plain_and_chat():
    tok = build_tokenizer("byte")
    records = [{"prompt": "2+2?", "response": "4"}, {"instruction": "add", "input": "1 1", "output": "2"}]
    (ids, labels), (ids2, labels2) = tokenize_records(records, tok, fmt="plain", max_len=128)
    assert _text(tok, labels) == "4<|endoftext|>" and _text(tok, ids).startswith("### Instruction:\n2+2?")
    assert _text(tok, labels2) == "2<|endoftext|>" and "add\n\n1 1" in _text(tok, ids2)
    assert labels[:len(ids) - 2] == [IGNORE] * (len(ids) - 2)  # everything before "4<eos>"
    conversation = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                 {"role": "user", "content": "2x3?"}, {"role": "assistant", "content": "6"}]}
    ((ids, labels),) = tokenize_records([conversation], tok, fmt="chat", max_len=256)
    assert tok.chat_template == CHATML  # none before: ChatML, saved with the tokenizer
    assert _text(tok, labels) == "6<|im_end|>\n"  # the last assistant turn only
    assert _text(tok, ids).endswith("<|im_start|>assistant\n6<|im_end|>\n")


def test_text_records_train_every_token_in_windows():
    tok = build_tokenizer("byte")
    examples = tokenize_records([{"text": "x" * 25}], tok, max_len=10)
    assert [len(ids) for ids, _ in examples] == [10, 10, 6] and all(ids == labels for ids, labels in examples)


def test_fields_are_named_or_detected_with_a_clear_error():
    tok = build_tokenizer("byte")
    fields = RecordFields(prompt="q", response="a")
    ((ids, labels),) = tokenize_records([{"q": "why", "a": "because"}], tok, fmt="plain", fields=fields)
    assert _text(tok, labels) == "because<|endoftext|>"
    with pytest.raises(ValueError, match="--prompt-field"):
        tokenize_records([{"foo": 1, "bar": 2}], tok)
    ((ids, labels),) = tokenize_records([{"prompt": "p" * 50 + "END", "response": "r"}], tok, fmt="plain", max_len=24)
    assert len(ids) == 24 and _text(tok, labels) == "r<|endoftext|>"
    assert "END" in _text(tok, ids)  # the prompt lost its start
    with pytest.raises(ValueError, match="no training example left"):
        tokenize_records([], tok)


def test_batches_are_padded_seeded_and_split_over_dp():
    examples = [([i] * (i + 1), [IGNORE] + [i] * i) for i in range(10)]
    batch = collate(examples[:3], pad_id=99, pad_multiple=4)
    assert batch["input_ids"].shape == (3, 4) and batch["attention_mask"].sum().item() == 1 + 2 + 3
    assert batch["labels"][0].tolist() == [IGNORE] * 4 and batch["input_ids"][0, 1:].tolist() == [99, 99, 99]
    whole = SFTBatches(examples, 2, 2, 0, seed=3)
    halves = [SFTBatches(examples, 2, 1, 0, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for step in range(4):  # wraps around the 10 examples
        ids = torch.cat([mb["input_ids"][:, 0] for mb in whole.batch(step)])
        assert ids.tolist() == torch.cat([h.batch(step)[0]["input_ids"][:, 0] for h in halves]).tolist()
    again = SFTBatches(examples, 2, 2, 0, seed=3)
    assert whole.batch(2)[0]["input_ids"].tolist() == again.batch(2)[0]["input_ids"].tolist()


# -- the perplexity metric ------------------------------------------------------------------

def test_local_evaluate_metric_needs_no_hub():
    import evaluate

    from taco_accel.training.finetune import perplexity
    from taco_accel.training.token_perplexity import MODULE_DIR

    metric = evaluate.load(MODULE_DIR)
    metric.add_batch(nll=[6.0, 2.0], tokens=[3, 1])
    result = metric.compute()
    assert result["perplexity"] == pytest.approx(math.exp(2.0)) and result["tokens"] == 4
    assert result["mean_sequence_perplexity"] == pytest.approx(math.exp(2.0))
    assert perplexity([6.0, 2.0], [3, 1]) == result


# -- the loop against one process -----------------------------------------------------------

def _run(base: str, out: str, **overrides) -> dict:
    from taco_accel.training.finetune import FinetuneConfig, Finetuner

    values = dict(model=base, data=str(SAMPLE), max_len=96, micro_batch_size=2, micro_batches=2, steps=3, lr=5e-3,
                  warmup_steps=1, eval_every=3, max_eval_examples=8, lora_r=4, output_dir=out, trackers=(),
                  progress=False, plot=False, export=False, device="cpu")
    cfg = FinetuneConfig(**{**values, **overrides})
    history = Finetuner(cfg).train()
    return {"losses": [r["loss"] for r in history if "loss" in r], "eval": history[-1]["eval_perplexity"],
            "eval_0": history[0]["eval_perplexity"]}


def _runs(base: str, out: str, meshes: list[dict]) -> list[dict]:
    from accelerate.state import AcceleratorState

    results = []
    for i, mesh in enumerate(meshes):
        AcceleratorState._reset_state()  # Accelerate fixes the mixed precision once per process state
        results.append(_run(base, os.path.join(out, str(i)), **mesh))
    return results


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> str:
    """A tiny Llama (one kv head: replicated over tp) and its byte tokenizer, saved like a hub checkpoint."""
    from taco_accel.training.finetune import tiny_checkpoint

    path = tmp_path_factory.mktemp("base") / "llama"
    tiny_checkpoint("llama", path, max_len=96, seed=4)
    return str(path)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_tp2_and_dp2_equal_one_process(base_checkpoint, tmp_path, method):
    off = dict(method=method, compression=None)  # fp32 (every precision: tests/test_entry_matrix.py)
    ref, = run_ranks(_runs, 1, base_checkpoint, str(tmp_path / "one"), [off])[0]
    meshes = [{**off, "tp": 2}, {**off, "dp": 2, "micro_batches": 1}]  # the same global batch of 4
    tp, dp = run_ranks(_runs, 2, base_checkpoint, str(tmp_path / "two"), meshes)[0]
    for run in (tp, dp):
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) < 1e-4, (run, ref)
        assert run["eval"] == pytest.approx(ref["eval"], rel=1e-4)
        assert run["eval_0"] == pytest.approx(ref["eval_0"], rel=1e-5)
    assert ref["eval"] < ref["eval_0"]  # it learns


def _resume(base: str, out: str) -> dict:
    """4 steps straight, against 2 steps (checkpoint at 2, stopped as a preempted job) and a new
    run resuming from it; tp=2, LoRA."""
    from taco_accel.training.finetune import FinetuneConfig, Finetuner

    values = dict(model=base, data=str(SAMPLE), max_len=96, micro_batch_size=2, micro_batches=1, steps=4, lr=5e-3,
                  warmup_steps=1, eval_every=0, max_eval_examples=4, lora_r=4, trackers=(), progress=False,
                  plot=False, export=False, device="cpu", compression=None, tp=2)
    losses = lambda history: [r["loss"] for r in history if "loss" in r]  # noqa: E731
    straight = losses(Finetuner(FinetuneConfig(**values, output_dir=os.path.join(out, "straight"))).train())
    first = losses(Finetuner(FinetuneConfig(**values, output_dir=os.path.join(out, "cut"), save_every=2)).train(until=2))
    resumed = losses(Finetuner(FinetuneConfig(**values, output_dir=os.path.join(out, "cut"), resume="latest")).train())
    return {"straight": straight, "first": first, "resumed": resumed}


def test_resume_repeats_the_uninterrupted_losses(base_checkpoint, tmp_path):
    r = run_ranks(_resume, 2, base_checkpoint, str(tmp_path))[0]
    assert r["first"] == r["straight"][:2]
    assert r["resumed"] == r["straight"]  # the history comes back with the checkpoint; steps 3-4 are new


# -- the recipes through accelerate launch --------------------------------------------------

def _launch(recipe: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    launch = documented(f"accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/{recipe}")  # docs/finetune.md's
    cmd = [*launch, "--steps", "3", "--eval-every", "3", "--max-len", "96", "--micro-batch-size", "2",
           "--max-eval-examples", "8", "--no-progress", "--device", "cpu", *args]
    done = run_command(cmd, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_lora_recipe_from_a_checkpoint_folder(base_checkpoint, tmp_path):
    """qwen_finetune.py on a saved tiny Llama folder, tp=2 with TACO: history, the metric, an adapter
    that plain peft loads on the original model and a merged checkpoint with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    done = _launch("qwen_finetune.py", tmp_path, "--model", base_checkpoint, "--output-dir", str(run),
                   "--lora-r", "4", "--lr", "5e-3", "--compression", "on")
    assert "tp=2" in done.stderr and "held-out perplexity" in done.stderr
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["comm_bytes_saved"] > 0
    results = json.loads((run / "eval_results.json").read_text())
    assert results["step"] == 3 and results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert json.loads((run / "adapter" / "eval_results.json").read_text()) == results
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base_checkpoint
    ids = AutoTokenizer.from_pretrained(run / "merged")("What is 2 + 3?", return_tensors="pt")["input_ids"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_checkpoint), run / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    base = AutoModelForCausalLM.from_pretrained(base_checkpoint)
    assert float((_logits(adapted, ids) - _logits(merged, ids)).abs().max()) < 1e-4
    assert float((_logits(base, ids) - _logits(merged, ids)).abs().max()) > 1e-3  # the adapter did something


def _recipe_in_ranks(argv: list[str]) -> None:
    """gpt_finetune.py's main in a rank of `run_ranks` (the launch environment is the other
    recipe test's): the recipe's code from its command line on, without a fresh interpreter."""
    import runpy

    recipe = runpy.run_path(str(ROOT / "recipes" / "gpt_finetune.py"))  # defines main; runs nothing
    recipe["main"]("gpt2", recipe["__doc__"].splitlines()[1], argv=argv, default_data=str(SAMPLE))


def test_full_finetune_recipe_with_chat_data(tmp_path):
    """gpt_finetune.py's command line, full fine-tuning of the tiny default GPT-2 on conversations
    (ChatML), no compression, tp=2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    argv = ["--steps", "3", "--eval-every", "3", "--max-len", "96", "--micro-batch-size", "2",
            "--max-eval-examples", "8", "--no-progress", "--device", "cpu", "--method", "full", "--data", str(CHAT),
            "--format", "chat", "--compression", "off", "--output-dir", str(run), "--trackers", "none", "--no-plot"]
    run_ranks(_recipe_in_ranks, 2, argv, env={"HF_HUB_OFFLINE": "1"})
    assert json.loads((run / "eval_results.json").read_text())["eval_tokens"] > 0
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.model_type == "gpt2" and tokenizer.chat_template == CHATML
