"""The runs of tests/test_entry_matrix.py: every entry point a user trains through, in every precision,
launched with taco_accel or run as the same script on one process with the plain classes.

``accelerate launch --config_file L.yaml entry_matrix_worker.py --out OUT --dir DIR --cells C`` runs the
cells ``C`` (``entry/precision,...``) on the launch's mesh: every entry reads its sizes from the launch
config, as a user's script does. ``python entry_matrix_worker.py --reference ...`` runs them on one
process: accelerate's Accelerator, the plain Trainer / SFTTrainer / DPOTrainer, and taco_accel's own
Finetuner and pretraining Trainer at tp=1; a cell ``entry/precision/tp1`` runs taco_accel's classes
on that one process (tp=1: the head and loss of `taco_accel.models.loss`, against the plain classes).
Every cell records which chunked functions its losses called (`harness.loss_paths`). Each run trains STEPS optimizer steps on the same global
batches of GLOBAL rows (each data-parallel replica GLOBAL / dp of them) and records its logged losses
and gradient norms (DPO: the policy's mean log-probability sums of the chosen and rejected
completions too), or its traceback. The reference also counts the roundings of one forward and
backward of each model in each low precision (tests/test_precision.py's count: the test's bounds).

Entries: ``loop`` (a user's own Accelerate loop), ``trainer`` / ``sft`` (transformers' Trainer, TRL's
SFTTrainer through taco_trainer), ``dpo`` / ``dpo_path`` / ``dpo_lora`` (TRL's DPOTrainer with a
reference model passed in, built by TRL from the policy's path, and a LoRA policy whose reference is
its disabled adapter), ``grpo`` (TRL's GRPOTrainer, its completions from `rollout`), ``finetuner``
(`taco_accel.training.Finetuner`, full fine-tuning) and ``recipes`` (the recipes' pretraining
`Trainer`). Precisions: ``fp32``; ``bf16``: autocast over fp32 parameters (Accelerate's ``mixed_precision="bf16"``, the Trainer's ``bf16=True``); ``bf16_params``:
the model in bf16, no autocast; ``fp16``: autocast and taco_accel's MeshGradScaler (Accelerate runs
fp16 on one CPU process as fp32, so the test compares it with the fp32 reference).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
from pathlib import Path

import torch
from harness import loss_paths
from hf_trainer_worker import VOCAB, guarded, history, lm_rows, preferences, texts, tiny, vowel_share

STEPS, GLOBAL = 2, 4  # optimizer steps; rows per optimizer step, over every replica
LR = 0.05  # SGD wherever the script picks its optimizer (the Finetuner and the recipes run their AdamW)
SFT_DATA = Path(__file__).resolve().parents[1] / "recipes" / "data" / "sft_sample.jsonl"
PRECISION_FLAGS = {  # TrainingArguments' flags (transformers wants use_cpu beside bf16 on a CPU machine)
    "fp32": dict(bf16=False), "bf16": dict(bf16=True, use_cpu=True), "bf16_params": dict(bf16=False),
    "fp16": dict(bf16=False, fp16=True),
}
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "bf16_params": "no", "fp16": "fp16"}
LOW_DTYPE = {"bf16": torch.bfloat16, "bf16_params": torch.bfloat16, "fp16": torch.float16}  # the roundings counted
AUTOCAST = {"bf16": torch.bfloat16, "bf16_params": None, "fp16": torch.float16}


class Run:
    """What one process's runs share: the launch or the reference, the dp size, the folders."""

    def __init__(self, args) -> None:
        self.reference, self.root = args.reference, Path(args.dir)
        self.plain = self.reference  # the plain classes (a tp1 cell of the reference: taco_accel's)
        self.dp = 1 if self.reference else int(os.environ["WORLD_SIZE"]) // 2  # tp=2 in every launch
        self.mesh = dict(tp=1, dp=1) if self.reference else {}  # {}: the launch config's sizes
        self.rank = int(os.environ.get("RANK", "0"))

    def with_taco(self) -> "Run":
        """This one process with taco_accel's classes (a ``tp1`` cell)."""
        run = copy.copy(self)
        run.plain = False
        return run

    def folder(self, name: str) -> str:
        return str(self.root / name)

    def trainer_class(self, cls):
        """The plain class (reference), or taco_trainer's (compression off: this matrix is about precision)."""
        if self.plain:
            return cls
        import taco_accel

        return taco_accel.taco_trainer(cls, compression=None)

    def dpo_base(self) -> str:
        """The tiny policy's checkpoint, written once (rank 0)."""
        path = self.root / "dpo_base"
        if self.rank == 0 and not path.is_dir():
            tiny().save_pretrained(path)
        if not self.reference:
            process_group().barrier()
        return str(path)


def process_group():
    """torch.distributed, initialised from the launch if no cell has yet (a DPO cell may come first)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def _dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16_params" else torch.float32


def _arguments(run: Run, name: str, precision: str, cls=None, default: str | None = None, **extra):
    """The Trainer's arguments of every Trainer cell: the global batch over the replicas, SGD;
    ``default``: a precision ``cls`` gives unasked (TRL's SFTConfig: bf16), left to it there."""
    from transformers import TrainingArguments

    flags = dict(PRECISION_FLAGS[precision])
    if precision == default:
        flags.pop("bf16")
    values = dict(output_dir=run.folder(f"{name}_{precision}"), per_device_train_batch_size=GLOBAL // run.dp,
                  gradient_accumulation_steps=1, max_steps=STEPS, learning_rate=LR, optim="sgd",
                  lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=7, save_strategy="no",
                  disable_tqdm=True, **flags, **extra)
    arguments = (cls or TrainingArguments)(**values)
    assert arguments.bf16 == (precision == "bf16"), arguments.bf16
    return arguments


def _trained(trainer) -> dict:
    """The figures of a Trainer cell (tests/hf_trainer_worker.py's `history`) and its gradient scaler."""
    trainer.train()
    return {**history(trainer), "scaler": type(trainer.accelerator.scaler).__name__}


# -- the entries ---------------------------------------------------------------------------------

def run_loop(run: Run, precision: str) -> dict:
    """A user's own loop: taco_accel.Accelerator with ``logits="none"`` (accelerate's on one process),
    the batch size per replica from ``num_processes``, the loss gathered over the replicas."""
    from torch.utils.data import DataLoader, TensorDataset

    if run.plain:
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision=MIXED_PRECISION[precision], cpu=True)
    else:  # the loss alone is read: the head and loss fused
        from taco_accel import Accelerator

        accelerator = Accelerator(mixed_precision=MIXED_PRECISION[precision], compression=None, logits="none")
    model = tiny().to(_dtype(precision))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = torch.stack([row["input_ids"] for row in lm_rows(STEPS * GLOBAL, 1)])
    loader = DataLoader(TensorDataset(rows), batch_size=GLOBAL // accelerator.num_processes)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for _, (ids,) in zip(range(STEPS), loader):
        loss = model(input_ids=ids, labels=ids).loss  # every token scored: each replica's mean weighs the same
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return {"losses": losses, "grad_norms": norms, "scaler": type(accelerator.scaler).__name__}


def run_trainer(run: Run, precision: str) -> dict:
    from transformers import Trainer

    trainer = run.trainer_class(Trainer)(model=tiny().to(_dtype(precision)), args=_arguments(run, "trainer", precision),
                                         train_dataset=lm_rows(STEPS * GLOBAL, 1))
    return _trained(trainer)


def run_sft(run: Run, precision: str) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    config = _arguments(run, "sft", precision, SFTConfig, default="bf16", max_length=48, dataset_num_proc=None)
    trainer = run.trainer_class(SFTTrainer)(
        model=tiny().to(_dtype(precision)), args=config, processing_class=build_tokenizer("byte"),
        train_dataset=Dataset.from_list(texts(STEPS * GLOBAL, 3)))
    return _trained(trainer)


def run_dpo(run: Run, precision: str, ref: str) -> dict:
    """``ref``: "passed" (a reference model given), "path" (TRL builds it from the policy's
    checkpoint and prepares it itself), "lora" (the reference is the LoRA policy's disabled adapter)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    path, dtype, extra = run.dpo_base(), _dtype(precision), {}
    if ref == "passed":
        extra["ref_model"] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if ref == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "v_proj", "down_proj"])
    # max_length 64 keeps every preference row (tests/hf_trainer_worker.py's run_dpo says why)
    config = _arguments(run, f"dpo_{ref}", precision, DPOConfig, max_length=64, beta=0.5, dataset_num_proc=None)
    trainer = run.trainer_class(DPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=dtype), args=config,
        processing_class=build_tokenizer("byte"), train_dataset=Dataset.from_list(preferences(STEPS * GLOBAL, 5)),
        **extra)
    if len(trainer.train_dataset) != STEPS * GLOBAL:
        raise ValueError(f"TRL kept {len(trainer.train_dataset)} of {STEPS * GLOBAL} preference rows")
    figures = _trained(trainer)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {**figures, "logps": [[h["logps/chosen"], h["logps/rejected"]] for h in logged]}


GENERATIONS = 2  # GRPO's completions per prompt: GLOBAL rows are GLOBAL / 2 prompts


def rollout(prompts: list, trainer) -> dict:
    """GRPO's completions (TRL's ``rollout_func``), made from each prompt and its place in its group
    alone: one process and every replica of every layout train the same rows, where sampling would
    draw each replica's from its own RNG stream (tests/test_hf_trainer.py samples at tp=2, where the
    draws are one process's). Letters and spaces (the reward's vowel shares differ within a group),
    3 to 6 tokens, then EOS: the token-count normaliser varies."""
    import random

    tokenizer, seen, completions = trainer.processing_class, {}, []
    letters = tokenizer("abcdefghijklmnopqrstuvwxyz ")["input_ids"]
    for prompt in prompts:  # each prompt once per generation batch (distinct prompts), GENERATIONS times in a row
        k = seen[prompt] = seen.get(prompt, -1) + 1
        draw = random.Random(f"{prompt}/{k}")
        completions.append([draw.choice(letters) for _ in range(3 + (k + len(prompt)) % 4)] + [tokenizer.eos_token_id])
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completions, "logprobs": None}


def run_grpo(run: Run, precision: str) -> dict:
    """TRL's GRPOTrainer (its defaults: the dapo loss, no reference model) on GLOBAL / GENERATIONS
    distinct prompts per step, completions from `rollout`, rewarded by their vowel share."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is TRL's experimental hook
    config = _arguments(run, "grpo", precision, GRPOConfig, num_generations=GENERATIONS, max_completion_length=8)
    prompts = [{"prompt": row["text"]} for row in texts(STEPS * GLOBAL // GENERATIONS, 8)]
    assert len({p["prompt"] for p in prompts}) == len(prompts), prompts  # distinct: `rollout` counts places per prompt
    trainer = run.trainer_class(GRPOTrainer)(
        model=tiny().to(_dtype(precision)), args=config, processing_class=build_tokenizer("byte"),
        reward_funcs=vowel_share, train_dataset=Dataset.from_list(prompts), rollout_func=rollout)
    figures = _trained(trainer)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {**figures, "entropy": [h["entropy"] for h in logged], "rewards": [h["reward"] for h in logged]}


def run_finetuner(run: Run, precision: str) -> dict:
    """Full fine-tuning of the Finetuner's tiny checkpoint on the shipped prompt/response sample:
    micro-batches of 2, as many per replica as make GLOBAL rows."""
    from taco_accel.training.finetune import FinetuneConfig, Finetuner

    config = FinetuneConfig(
        data=str(SFT_DATA), method="full", max_len=64, micro_batch_size=2, micro_batches=GLOBAL // 2 // run.dp,
        steps=STEPS, lr=5e-3, warmup_steps=0, eval_every=0, max_eval_examples=4, trackers=(), progress=False,
        plot=False, export=False, device="cpu", compression=None, mixed_precision=MIXED_PRECISION[precision],
        dtype="bfloat16" if precision == "bf16_params" else "auto", output_dir=run.folder(f"finetuner_{precision}"),
        **run.mesh)
    rows = [row for row in Finetuner(config).train() if "loss" in row]
    return {"losses": [row["loss"] for row in rows], "grad_norms": [row["grad_norm"] for row in rows]}


def run_recipes(run: Run, precision: str) -> dict:
    """The recipes' pretraining Trainer, nano preset, on random tokens (its `load_tokens` hook)."""
    from harness import random_tokens_trainer

    from taco_accel.training import TrainConfig

    RandomTokens = random_tokens_trainer(VOCAB, 2048, 256)

    config = TrainConfig(
        family="qwen2", preset="nano", seq_len=16, micro_batch_size=2, micro_batches=GLOBAL // 2 // run.dp,
        steps=STEPS, lr=1e-2, warmup_steps=0, eval_every=0, eval_batches=1, trackers=(), progress=False,
        export=False, plot=False, output_dir=None, compression=None, device="cpu",
        mixed_precision=MIXED_PRECISION[precision], **run.mesh)
    rows = RandomTokens(config).train()
    return {"losses": [row["loss"] for row in rows], "grad_norms": [row["grad_norm"] for row in rows]}


ENTRIES = {
    "loop": run_loop, "trainer": run_trainer, "sft": run_sft,
    "dpo": functools.partial(run_dpo, ref="passed"), "dpo_path": functools.partial(run_dpo, ref="path"),
    "dpo_lora": functools.partial(run_dpo, ref="lora"), "grpo": run_grpo, "finetuner": run_finetuner,
    "recipes": run_recipes,
}


def run_cell(run: Run, cell: str) -> dict:
    """One cell in a fresh Accelerate state (its mixed precision is fixed once per state; the process
    group stays). A launched cell in low precision also counts the operations that wrote a tensor of
    that precision (`test_precision._Roundings`): none would mean it trained in fp32."""
    from accelerate.state import AcceleratorState, GradientState
    from test_precision import _Roundings

    entry, precision, *taco = cell.split("/")
    run = run.with_taco() if taco else run
    AcceleratorState._reset_state()
    GradientState._reset_state()
    gc.freeze()  # what the process holds so far: the Trainer's gc.collect at train() scans this cell's objects only
    with loss_paths() as paths:
        if run.reference or precision not in LOW_DTYPE:
            return {**ENTRIES[entry](run, precision), "loss_paths": paths}
        count = _Roundings(LOW_DTYPE[precision])
        with count:
            figures = ENTRIES[entry](run, precision)
    return {**figures, "low_precision_ops": count.count, "loss_paths": paths}


# -- what the test's bounds count -------------------------------------------------------------------

def models() -> dict:
    """The model of each entry: ``tiny`` (the loop and the Trainer cells), the Finetuner's and the recipes'."""
    from taco_accel.models.tiny import tiny_model
    from taco_accel.training.finetune import TINY_VOCAB
    from taco_accel.training.presets import model_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    recipes = AutoModelForCausalLM.from_config(model_config("qwen2", "nano", vocab_size=TINY_VOCAB, max_positions=16))
    return {"tiny": tiny(), "finetuner": tiny_model("qwen2", vocab_size=TINY_VOCAB, max_position_embeddings=64),
            "recipes": recipes}


def roundings() -> dict:
    """``{model: {precision: [roundings of one forward, of forward and backward], "params": tensors}}``:
    test_precision's count (every op that writes a low-precision tensor) on one batch of GLOBAL rows."""
    from test_precision import _step

    out = {}
    for name, model in models().items():
        ids = torch.randint(0, model.config.vocab_size, (GLOBAL, 16), generator=torch.Generator().manual_seed(3))
        counts = {"params": len(list(model.parameters()))}
        for precision, dtype in LOW_DTYPE.items():
            step = _step(copy.deepcopy(model).to(_dtype(precision)), ids, ids, AUTOCAST[precision], dtype)
            counts[precision] = [step["n_fwd"], step["n_all"]]
        out[name] = counts
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--cells", required=True, help="entry/precision[/tp1],... (entries: ENTRIES)")
    p.add_argument("--reference", action="store_true", help="the plain classes (Finetuner, recipes: tp=1), one process")
    args = p.parse_args()
    run = Run(args)
    cells = args.cells.split(",")
    result = guarded({cell: functools.partial(run_cell, run, cell) for cell in cells}, cells)
    if args.reference:
        result["roundings"] = roundings()
    if run.rank == 0:
        Path(args.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
