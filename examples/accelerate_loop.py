#!/usr/bin/env python
"""The smallest complete Accelerate training loop with TACO tensor parallelism.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml examples/accelerate_loop.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --tp 2   # no config file
    python examples/accelerate_loop.py                                                 # one process: emulated tp=2

Against a plain Accelerate loop, one line differs: ``from taco_accel import Accelerator``. The
tensor-parallel size comes from the launch config's ``parallelism_config`` block (or
``ParallelismConfig(tp_size=...)`` in code); the processes it leaves form data-parallel
replicas when the config says so (``parallelism_config_dp_replicate_size``, or
``parallelism_config_dp_shard_size`` for FSDP2). ``prepare`` makes the model tensor parallel,
the DataLoader gives the tp ranks of a replica the same batches, gradients are averaged over
the replicas only.
"""

import argparse
import os

import torch
from accelerate import ParallelismConfig
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, Qwen2Config

from taco_accel import Accelerator, TacoConfig
from taco_accel.data import load_texts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the launch config's parallelism_config; "
                    "without one, all processes, or 2 emulated in a single process)")
parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
parser.add_argument("--compression", choices=("on", "off"), default="on")
parser.add_argument("--output-dir", default="runs/accelerate_loop")
args = parser.parse_args()

# Compression: on (a TacoConfig) compresses every message, to show TACO's numerics on a tiny model
# whose messages are far too small for the codec to pay; a real run keeps the default "auto".
compression = TacoConfig(group_size=64) if args.compression == "on" else None
if args.tp is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") != "true":
    args.tp = max(int(os.environ.get("WORLD_SIZE", "1")), 2)  # no sizes from the launch: this example's default
sizes = ParallelismConfig(tp_size=args.tp) if args.tp else None  # None: the launch config's
accelerator = Accelerator(parallelism_config=sizes, gradient_accumulation_steps=2, compression=compression,
                          log_with="tensorboard", project_dir=args.output_dir)

# A tiny Qwen2 (the same weights on every rank: the same seed) and byte-level text windows.
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(Qwen2Config(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64))
text = "".join(load_texts(None)[:4]).encode("utf-8", "ignore")[:64 * 1024]
windows = torch.tensor(list(text), dtype=torch.long)[: len(text) // 64 * 64].view(-1, 64)
loader = DataLoader(TensorDataset(windows), batch_size=4, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))

model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
accelerator.init_trackers("accelerate_loop")
step = 0
while step < args.steps:
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            mean_loss = accelerator.reduce(loss.detach(), "mean").item()
            accelerator.log({"loss": mean_loss, "grad_norm": grad_norm.item(), **accelerator.compression_stats()},
                            step=step)
            if step % 10 == 0:
                accelerator.print(f"step {step}: loss {mean_loss:.4f} grad norm {grad_norm.item():.3f}")
            if step == args.steps:
                break

accelerator.save_state(f"{args.output_dir}/state")          # every rank's shard; load_state resumes
accelerator.save_model(model, f"{args.output_dir}/model")   # a plain transformers checkpoint
accelerator.end_training()
accelerator.print(f"done: {accelerator.parallel_layout}, TACO {args.compression}; "
                  f"model in {args.output_dir}/model")
