"""A user's causal-LM training script, written the way transformers' example
``examples/pytorch/language-modeling/run_clm_no_trainer.py`` (transformers 4.30 - 5.x) is: the
same arguments, the same Accelerate conventions, the same step arithmetic, offline.

What it shares with that example, line for line in behaviour (this file is our own code):
- ``Accelerator(gradient_accumulation_steps=...)``; ``set_seed``; texts concatenated and cut
  into blocks of ``--block_size`` with ``labels = input_ids``; a shuffled training DataLoader
  and an evaluation one with ``default_data_collator``; AdamW over two groups (no weight decay
  for biases and norm weights).
- The schedule, sized BEFORE ``prepare``: ``num_update_steps_per_epoch =
  ceil(len(train_dataloader) / accumulation)``; without ``--max_train_steps`` it is
  ``epochs * num_update_steps_per_epoch`` (the un-sharded DataLoader's length) and the
  scheduler gets it as is; with ``--max_train_steps`` the scheduler gets ``max_train_steps *
  accelerator.num_processes``; warm-up is ``num_warmup_steps * accelerator.num_processes`` on
  both paths (Accelerate steps a prepared scheduler ``num_processes`` times per optimizer step).
- After ``prepare``: the steps per epoch recomputed from the sharded DataLoader, the epochs
  from ``max_train_steps``; the log line "Total train batch size (w. parallel, distributed &
  accumulation) = per_device * num_processes * accumulation".
- Training under ``accelerator.accumulate(model)`` with ``accelerator.backward(outputs.loss)``,
  ``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``; evaluation of
  ``gather_for_metrics(loss.repeat(per_device_eval_batch_size))`` into perplexity per epoch.

Offline adaptations (there is no hub): the model is built from ``--model_type`` and
``--config_overrides`` (the example's from-scratch path), the text is tokenized as UTF-8 bytes
(vocabulary 256) instead of by a hub tokenizer, and the ``.txt`` files are read directly
instead of through ``datasets.load_dataset("text", ...)`` (the same lines, without the cache).
The import of ``Accelerator`` is the one line a taco_accel user changes.
"""

import argparse
import logging
import math

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, SchedulerType, default_data_collator, get_scheduler, set_seed

from taco_accel import Accelerator  # the user's one change: was `from accelerate import Accelerator`

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser(description="Train a causal language model on text files with Accelerate")
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", required=True)
    p.add_argument("--model_type", default="qwen2")
    p.add_argument("--config_overrides", default="", help="e.g. hidden_size=64,num_hidden_layers=2")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block_size", type=int, default=32)
    return p.parse_args()


def overrides(text: str) -> dict:
    """``"a=1,b=0.5"`` -> ``{"a": 1, "b": 0.5}`` (ints, floats, else strings)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        out[key] = value
    return out


def blocks(path: str, block_size: int) -> list[dict]:
    """The file's lines as one byte stream, cut into ``block_size`` blocks (the remainder dropped)."""
    with open(path, encoding="utf-8") as f:
        ids = [b for line in f.read().splitlines() for b in line.encode("utf-8")]
    usable = len(ids) // block_size * block_size
    return [{"input_ids": ids[i:i + block_size], "labels": ids[i:i + block_size]} for i in range(0, usable, block_size)]


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.setLevel(logging.INFO if accelerator.is_local_main_process else logging.ERROR)
    if args.seed is not None:
        set_seed(args.seed)

    train_dataset = blocks(args.train_file, args.block_size)
    eval_dataset = blocks(args.validation_file, args.block_size)
    config = AutoConfig.for_model(args.model_type, vocab_size=256, **overrides(args.config_overrides))
    model = AutoModelForCausalLM.from_config(config)

    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)

    # the schedule, sized before prepare (the DataLoader is not sharded yet)
    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    # the DataLoader is sharded now: recompute the steps and the epochs
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")

    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
