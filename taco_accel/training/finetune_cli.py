"""The command line of the fine-tuning recipes: argparse -> `FinetuneConfig` -> `Finetuner`."""

from __future__ import annotations

import argparse

from .cli import (
    ArgumentParser, HelpFormatter, add_compression_args, add_optimisation_args, add_timeout_arg, compression_from_args,
    data_source, mixed_precision_from_args, non_negative_int, positive_int, setup_logging, trackers_from_args,
    usage_errors,
)
from .finetune import DTYPES, METHODS, TINY, FinetuneConfig, Finetuner


def build_parser(family: str, description: str, default_data: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=TINY, help=f"a hub name or a local checkpoint folder; '{TINY}': a random tiny "
                   f"{family} with a byte tokenizer, written to OUTPUT_DIR/base (no network)")
    m.add_argument("--method", default="lora", choices=METHODS, help="LoRA through peft, or full fine-tuning")
    m.add_argument("--lora-r", type=positive_int, default=16, help="LoRA rank")
    m.add_argument("--lora-alpha", type=positive_int, default=32, help="LoRA scale numerator (scale alpha / r)")
    m.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input, in [0, 1)")
    m.add_argument("--target-modules", default="all-linear", help="'all-linear' or comma-separated module names")
    m.add_argument("--dtype", default="auto", choices=DTYPES, help="weights as loaded (auto: the checkpoint's for "
                   "LoRA on GPUs, float32 otherwise)")
    par = p.add_argument_group("parallelism (unset: from accelerate launch or the world size)")
    par.add_argument("--tp", type=positive_int, help="tensor-parallel size (default: the launch config's, else "
                     "every process)")
    par.add_argument("--dp", type=positive_int, help="data-parallel replicas (default: the processes tp leaves)")
    par.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism in TP")
    add_compression_args(p, small="the tiny model")
    d = p.add_argument_group("data")
    d.add_argument("--data", type=data_source, default=default_data, help="a datasets name[:config], or local "
                   ".jsonl/.json/.txt/.parquet")
    d.add_argument("--eval-data", type=data_source, help="held-out data (default: every 1/EVAL_FRACTION-th example of --data)")
    d.add_argument("--split", default="train", help="datasets split of --data")
    d.add_argument("--eval-split", help="datasets split of the held-out data, e.g. test")
    d.add_argument("--format", default="auto", choices=("auto", "chat", "plain"),
                   help="chat template or plain prompt template (auto: chat if the tokenizer has a template)")
    d.add_argument("--prompt-field", help="record field of the prompt (default: detected)")
    d.add_argument("--response-field", help="record field of the response (default: detected)")
    d.add_argument("--text-field", default="text", help="record field of plain text (all tokens trained)")
    d.add_argument("--messages-field", default="messages", help="record field of a conversation")
    d.add_argument("--system-prompt", help="a system message for chat formatting")
    d.add_argument("--tokenizer", help="a local tokenizer folder (default: the checkpoint's)")
    d.add_argument("--max-len", type=positive_int, default=512, help="tokens per example (longer ones are cut; at "
                   "most the model's positions)")
    d.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share of --data when there is no "
                   "--eval-data / --eval-split, in [0, 1)")
    d.add_argument("--max-eval-examples", type=positive_int, default=256, help="held-out examples evaluated")
    d.add_argument("--micro-batch-size", type=positive_int, default=4, help="examples per micro-batch and dp replica")
    d.add_argument("--micro-batches", type=positive_int, default=1, help="micro-batches per step (gradient "
                   "accumulation)")
    add_optimisation_args(p, steps=100, lr=None, warmup=10, weight_decay=0.0,
                          lr_help="default: 2e-4 for LoRA, 2e-5 for full fine-tuning")
    r = p.add_argument_group("evaluation, logging, output")
    r.add_argument("--eval-every", type=non_negative_int, default=50, help="evaluation every N steps (0: before "
                   "and after training only)")
    r.add_argument("--log-every", type=positive_int, default=10, help="a log line every N steps")
    r.add_argument("--output-dir", default=f"runs/{family}_finetune", help="history, plots, checkpoints, exports")
    r.add_argument("--trackers", default="tensorboard", help="comma-separated Accelerate trackers, or 'none'")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--save-every", type=non_negative_int, default=0, help="checkpoint every N steps (0: never)")
    r.add_argument("--resume", help="'latest' (the newest undamaged one under OUTPUT_DIR/checkpoints) or a step_N "
                   "folder (default: start from scratch)")
    r.add_argument("--no-export", action="store_true", help="skip the adapter / merged / final export")
    r.add_argument("--no-merge", action="store_true", help="LoRA: write the adapter only")
    r.add_argument("--no-plot", action="store_true", help="no loss-curve PNG")
    r.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, unless the launch "
                   "says to use the CPU (--cpu, use_cpu: true)")
    add_timeout_arg(r)
    return p


def _hidden_size(model: str) -> int:
    """The hidden size of a local checkpoint (64 for the tiny model; 128 when it cannot be read)."""
    if model == TINY:
        return 64
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, local_files_only=True)
        return getattr(config, "hidden_size", None) or getattr(config, "n_embd", 128)
    except (OSError, ValueError):
        return 128


def config_from_args(family: str, args) -> FinetuneConfig:
    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    return FinetuneConfig(
        model=args.model, family=family, method=args.method, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout, target_modules=targets, tp=args.tp, dp=args.dp,
        sequence_parallel=args.sequence_parallel, compression=compression_from_args(args, _hidden_size(args.model), small=args.model == TINY),
        grad_compression=args.grad_compression,
        data=args.data, eval_data=args.eval_data, split=args.split, eval_split=args.eval_split, format=args.format,
        prompt_field=args.prompt_field, response_field=args.response_field, text_field=args.text_field,
        messages_field=args.messages_field, system_prompt=args.system_prompt, tokenizer=args.tokenizer,
        max_len=args.max_len, eval_fraction=args.eval_fraction, max_eval_examples=args.max_eval_examples,
        micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches, steps=args.steps,
        lr=args.lr or (2e-4 if args.method == "lora" else 2e-5), min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        mixed_precision=mixed_precision_from_args(args), dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
        compile_backend=args.compile_backend, seed=args.seed, eval_every=args.eval_every,
        log_every=args.log_every, output_dir=args.output_dir,
        trackers=trackers_from_args(args),
        progress=not args.no_progress, export=not args.no_export, merge=not args.no_merge, plot=not args.no_plot,
        save_every=args.save_every, resume=args.resume, device=args.device, timeout_s=args.timeout,
    )


def main(family: str, description: str, argv=None, default_data: str | None = None) -> list[dict]:
    """Parse the command line, fine-tune, export; returns the history (on every rank)."""
    parser = build_parser(family, description, default_data)
    args = parser.parse_args(argv)
    setup_logging()
    with usage_errors(parser):
        finetuner = Finetuner(config_from_args(family, args))
        finetuner.check_output_folder()
    history = finetuner.train()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return history
