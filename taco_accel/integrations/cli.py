"""The command line shared by the recipes: argparse -> `TrainConfig` -> `Trainer`."""

from __future__ import annotations

import argparse
import json
import logging
import os

from ..codec import TacoConfig
from .presets import FAMILY_PRESETS
from .trainer import MIXED_PRECISION, TrainConfig, Trainer
from ..parallel import SCHEDULES

SMALL_PRESETS = ("nano", "tiny")


def build_parser(family: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="tiny", choices=list(FAMILY_PRESETS[family]), help="model size")
    par = p.add_argument_group("parallelism (unset: from accelerate launch, TACO_PP_SIZE, the world size)")
    par.add_argument("--tp", type=int, help="tensor-parallel size")
    par.add_argument("--pp", type=int, help="pipeline stages")
    par.add_argument("--dp", type=int, help="data-parallel replicas")
    par.add_argument("--dp-mode", choices=("ddp", "fsdp"), help="DDP (default) or FSDP2 over dp")
    par.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    par.add_argument("--stages-per-rank", type=int, help="virtual stages per pp rank (interleaved: 2)")
    par.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism in TP")
    add_compression_args(p, small="nano/tiny")
    d = p.add_argument_group("data")
    d.add_argument("--data", help="datasets name[:config], or local .txt/.jsonl/.parquet files (default: the "
                   "shipped stdlib corpus)")
    d.add_argument("--text-field", default="text")
    d.add_argument("--tokenizer", default="byte", help="byte, bpe:N (trained and cached), or a local tokenizer folder")
    d.add_argument("--seq-len", type=int, default=128)
    d.add_argument("--micro-batch-size", type=int, default=4)
    d.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    add_optimisation_args(p, steps=200, lr=3e-3, warmup=20, weight_decay=0.1)
    r = p.add_argument_group("evaluation, logging, checkpoints")
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--eval-batches", type=int, default=4)
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--output-dir", default=f"runs/{family}_pretrain")
    r.add_argument("--trackers", default="tensorboard", help="comma-separated Accelerate trackers, or 'none'")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    r.add_argument("--resume", help="'latest' (under OUTPUT_DIR/checkpoints) or a step_N folder")
    r.add_argument("--no-export", action="store_true", help="skip the final transformers export")
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--cache-dir", help="tokenizer and token cache (default: OUTPUT_DIR/cache)")
    r.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available (cpu: gloo on a GPU machine)")
    return p


def add_compression_args(p: argparse.ArgumentParser, small: str) -> None:
    """--compression, --group-size, --compression-threshold (``small``: the models whose
    threshold defaults to 0, for the help text)."""
    c = p.add_argument_group("TACO compression of the TP collectives")
    c.add_argument("--compression", default="on", help="on, off, or a JSON settings file (TacoConfig fields, "
                   "or {'forward': {...}|null, 'backward': {...}|null, 'sites': {pattern: {...}|null}})")
    c.add_argument("--group-size", type=int, help="codec group size G (default: 128, or the hidden size if smaller)")
    c.add_argument("--compression-threshold", type=int,
                   help=f"bytes below which a collective stays plain (default: TacoConfig's 8 MiB; 0 for {small})")


def add_optimisation_args(p: argparse.ArgumentParser, *, steps: int, lr: float | None, warmup: int,
                          weight_decay: float, lr_help: str | None = None) -> None:
    """The optimisation flags both recipes share, with the recipe's defaults."""
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=steps)
    o.add_argument("--lr", type=float, default=lr, help=lr_help)
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--warmup", type=int, default=warmup)
    o.add_argument("--weight-decay", type=float, default=weight_decay)
    o.add_argument("--max-grad-norm", type=float, default=1.0)
    o.add_argument("--mixed-precision", choices=MIXED_PRECISION, help="default: bf16 on GPUs, no on CPU")
    o.add_argument("--seed", type=int, default=0)


def mixed_precision_from_args(args) -> str:
    """--mixed-precision, else bf16 on a GPU run and no on the CPU."""
    import torch

    return args.mixed_precision or ("bf16" if torch.cuda.is_available() and args.device != "cpu" else "no")


def trackers_from_args(args) -> tuple:
    return () if args.trackers == "none" else tuple(t for t in args.trackers.split(",") if t)


def setup_logging() -> None:
    """INFO on global rank 0, warnings elsewhere."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def compression_from_args(args, hidden_size: int, small: bool | None = None):
    """The ``compression`` value for parallelize from --compression/--group-size/--compression-threshold.

    ``small``: a tiny model, whose messages are all under the default threshold, so every one
    is compressed (default: whether ``args.preset`` is one of the small presets)."""
    if args.compression == "off":
        return None
    overrides = {}
    if args.group_size:
        overrides["group_size"] = args.group_size
    elif hidden_size < 128:
        overrides["group_size"] = 1 << (hidden_size.bit_length() - 1)  # largest power of two <= h
    if args.compression_threshold is not None:
        overrides["threshold_bytes"] = args.compression_threshold
    elif small if small is not None else args.preset in SMALL_PRESETS:
        overrides["threshold_bytes"] = 0  # tiny models' messages are all below 8 MiB
    if args.compression == "on":
        return TacoConfig(**overrides)
    if not os.path.isfile(args.compression):
        raise ValueError(f"--compression {args.compression!r}: use on, off or a JSON settings file")
    with open(args.compression) as f:
        values = json.load(f)
    if set(values) <= {"forward", "backward", "sites"}:
        def conf(v):
            return None if v is None else TacoConfig.from_dict({**overrides, **v})
        out = {k: conf(values[k]) for k in ("forward", "backward") if k in values}
        out["sites"] = {pat: conf(v) for pat, v in values.get("sites", {}).items()}
        return out
    return TacoConfig.from_dict({**overrides, **values})


def config_from_args(family: str, args) -> TrainConfig:
    preset = FAMILY_PRESETS[family][args.preset]
    hidden = preset.get("hidden_size", preset.get("n_embd"))
    return TrainConfig(
        family=family, preset=args.preset, pp=args.pp, dp=args.dp, tp=args.tp, dp_mode=args.dp_mode,
        schedule=args.schedule, stages_per_rank=args.stages_per_rank, sequence_parallel=args.sequence_parallel,
        compression=compression_from_args(args, hidden), data=args.data, text_field=args.text_field,
        tokenizer=args.tokenizer, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, steps=args.steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        mixed_precision=mixed_precision_from_args(args), seed=args.seed,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
        output_dir=args.output_dir,
        trackers=trackers_from_args(args), progress=not args.no_progress, save_every=args.save_every, resume=args.resume, export=not args.no_export,
        plot=not args.no_plot, cache_dir=args.cache_dir, device=args.device,
    )


def main(family: str, description: str, argv=None) -> list[dict]:
    """Parse the command line, train, return the history (on every rank)."""
    args = build_parser(family, description).parse_args(argv)
    setup_logging()
    trainer = Trainer(config_from_args(family, args))
    history = trainer.train()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return history
