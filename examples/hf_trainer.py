#!/usr/bin/env python
"""transformers' Trainer or TRL's SFTTrainer with TACO tensor parallelism: two changed lines.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml examples/hf_trainer.py             # 2 CPU processes, tp=2
    accelerate launch --config_file recipes/configs/cpu_tp2.yaml examples/hf_trainer.py --trainer hf --lora
    accelerate launch --multi_gpu --num_processes 4 examples/hf_trainer.py --tp 2                   # dp=2 x tp=2, no config
    python examples/hf_trainer.py                                                                  # one process: tp=2 emulated

Against the plain script, the import of `taco_trainer` and ``taco_trainer(SFTTrainer)(...)``
instead of ``SFTTrainer(...)`` differ (any Trainer subclass works the same way). The sizes come
from the launch config's ``parallelism_config`` block, or from
``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=...))``; the processes tp
leaves are data-parallel replicas. Everything else is the Trainer's own: ``save_steps`` and
``resume_from_checkpoint``, ``evaluate()``, ``save_model`` (a plain transformers checkpoint, or
the peft adapter), LoRA through ``peft_config``; the logs carry TACO's ``comm/bytes_sent``,
``comm/bytes_saved`` and ``comm/compression``.
"""

import argparse
import os

from accelerate import ParallelismConfig
from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen2Config, Trainer, TrainingArguments, set_seed

from taco_accel import TacoConfig, taco_trainer  # changed line 1
from taco_accel.data import build_tokenizer, load_texts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--trainer", choices=("sft", "hf"), default="sft", help="TRL's SFTTrainer or transformers' Trainer")
parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the launch config's parallelism_config; "
                    "without one, 2)")
parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of every weight")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--compression", choices=("on", "off"), default="on")
parser.add_argument("--output-dir", default="runs/hf_trainer")
parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --output-dir")
args = parser.parse_args()

if args.tp is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") != "true":
    args.tp = 2  # no sizes from the launch: this example's default
sizes = ParallelismConfig(tp_size=args.tp) if args.tp else None  # None: the launch config's
# On (a TacoConfig) compresses every message, to show TACO's numerics on a tiny model whose messages
# are far too small for the codec to pay; a real run keeps the default "auto".
compression = TacoConfig(group_size=64) if args.compression == "on" else None

tokenizer = build_tokenizer("byte")  # 256 bytes + <|endoftext|>, nothing to download
set_seed(0)  # a model built from a config: the same weights on every rank (from_pretrained needs no seed)
model = AutoModelForCausalLM.from_config(Qwen2Config(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128))
docs = [doc[i:i + 200] for doc in load_texts(None)[:8] for i in range(0, len(doc), 200)]
train, held_out = Dataset.from_dict({"text": docs[:-32]}), Dataset.from_dict({"text": docs[-32:]})
lora = None
if args.lora:
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
common = dict(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=3e-3,
              logging_steps=5, save_steps=10, eval_strategy="steps", eval_steps=10, report_to=["tensorboard"],
              parallelism_config=sizes)

if args.trainer == "sft":
    from trl import SFTConfig, SFTTrainer

    trainer = taco_trainer(SFTTrainer, compression=compression)(  # changed line 2: SFTTrainer(...) before
        model=model, args=SFTConfig(**common, max_length=128, bf16=False), processing_class=tokenizer,
        train_dataset=train, eval_dataset=held_out, peft_config=lora)
else:
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora)

    def tokenize(batch):
        ids = tokenizer(batch["text"], max_length=128, truncation=True, padding="max_length")["input_ids"]
        return {"input_ids": ids, "labels": [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in ids]}

    trainer = taco_trainer(Trainer, compression=compression)(  # changed line 2: Trainer(...) before
        model=model, args=TrainingArguments(**common), train_dataset=train.map(tokenize, batched=True,
                                                                               remove_columns=["text"]),
        eval_dataset=held_out.map(tokenize, batched=True, remove_columns=["text"]))

trainer.train(resume_from_checkpoint=True if args.resume else None)
metrics = trainer.evaluate()
if trainer.is_world_process_zero():
    print(metrics)
trainer.save_model(f"{args.output_dir}/final")  # the gathered model (or the adapter), loadable on one process
