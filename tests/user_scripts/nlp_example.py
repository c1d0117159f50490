"""A user's Accelerate script written the way accelerate's ``examples/complete_nlp_example.py``
(accelerate 1.x) is, with its classification task turned into next-token prediction: the
evaluation metric is an accuracy computed from ``outputs.logits.argmax(-1)``.

What it shares with that example (this file is our own code): ``training_function(config,
args)`` with ``lr / num_epochs / seed / batch_size`` in a config dict; batches above
``MAX_GPU_BATCH_SIZE`` become gradient accumulation (``loss / accumulation`` and a step every
``accumulation`` batches, no ``accelerator.accumulate``); ``set_seed``; the model moved to
``accelerator.device`` before ``prepare``; ``get_linear_schedule_with_warmup`` sized before
``prepare`` from the un-sharded DataLoader (``len(train_dataloader) * num_epochs //
accumulation``); evaluation under ``torch.no_grad()`` with ``predictions =
outputs.logits.argmax(dim=-1)``, ``accelerator.gather_for_metrics((predictions, references))``,
``metric.add_batch`` / ``metric.compute`` and ``accelerator.print(f"epoch {epoch}:",
eval_metric)``.

Adaptations: next-token prediction instead of MRPC classification (a causal LM built from a
config, UTF-8 byte tokens, references = the labels shifted by one); offline, no hub: the
text comes from files instead of ``datasets.load_dataset("glue", "mrpc")``, the metric is an
accuracy counted here instead of ``evaluate.load("glue", "mrpc")``, and ``lr`` / ``num_epochs`` /
``batch_size`` / the warm-up come from the command line so that a test runs in seconds.
Checkpointing and tracking are left out. The import of ``Accelerator`` is the one line a
taco_accel user changes.
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import (AutoConfig, AutoModelForCausalLM, default_data_collator, get_linear_schedule_with_warmup,
                          set_seed)

from taco_accel import Accelerator  # the user's one change: was `from accelerate import Accelerator`

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 8


class Accuracy:
    """``evaluate``'s accuracy, offline: ``add_batch`` then ``compute``."""

    def __init__(self):
        self.correct, self.total = 0, 0

    def add_batch(self, predictions, references):
        self.correct += int((predictions == references).sum())
        self.total += references.numel()

    def compute(self):
        accuracy, self.correct, self.total = self.correct / self.total, 0, 0
        return {"accuracy": accuracy}


def get_dataloaders(accelerator: Accelerator, batch_size: int, args):
    def blocks(path):
        with open(path, encoding="utf-8") as f:
            ids = list(f.read().encode("utf-8"))
        usable = len(ids) // args.block_size * args.block_size
        return [{"input_ids": ids[i:i + args.block_size], "labels": ids[i:i + args.block_size]}
                for i in range(0, usable, args.block_size)]

    with accelerator.main_process_first():
        train, validation = blocks(args.train_file), blocks(args.validation_file)
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=default_data_collator, batch_size=batch_size,
                                  drop_last=True)
    eval_dataloader = DataLoader(validation, shuffle=False, collate_fn=default_data_collator,
                                 batch_size=EVAL_BATCH_SIZE, drop_last=False)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    metric = Accuracy()
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size, args)
    model_config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(model_config)
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)  # the prepared DataLoader placed the batch
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)[:, :-1]  # token t predicts token t + 1
            references = batch["labels"][:, 1:]
            predictions, references = accelerator.gather_for_metrics((predictions, references))
            metric.add_batch(predictions=predictions, references=references)

        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_warmup_steps", type=int, default=100)
    args = parser.parse_args()
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
