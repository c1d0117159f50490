"""The command line shared by the recipes: argparse -> `TrainConfig` -> `Trainer`.

Every rank of a launch parses the same command line. A mistake in it (a bad flag value, a
mesh the processes do not fit, a missing data file or checkpoint, a previous run in the output
folder) is one argparse-style line, printed once (global rank 0) and left for the launcher's
failure summary, and every rank exits with status 2 (`ArgumentParser`, `usage_errors`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from ..comm.policy import DEFAULT_MODE, MODES, Compression
from ..errors import TacoError
from ..parallel import SCHEDULES
from .ranks import global_rank, record_failure
from .presets import FAMILY_PRESETS
from .trainer import MIXED_PRECISION, TrainConfig, Trainer, device_type

logger = logging.getLogger(__name__)
SMALL_PRESETS = ("nano", "tiny")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is one; a help text says what an unset (None) option means."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for a command that every rank of a launch runs: an error is printed once, on
    global rank 0 (usage, then ``prog: error: message`` as the last line), recorded for the
    launcher's failure summary (`record_failure`), and every rank exits with status 2."""

    def error(self, message: str):
        if global_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.stderr.flush()
            record_failure(f"{self.prog}: error: {message}")
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser):
    """Turn what a run's settings make the library refuse while the run is built (bad values,
    files that are missing or unreadable, a mesh the processes do not fit) into
    ``parser.error``: one line, once, exit status 2. Errors of the training itself keep their
    tracebacks."""
    try:
        yield
    except (TacoError, ValueError, TypeError, OSError) as e:
        logger.debug("the run's settings were refused", exc_info=True)
        parser.error(" ".join(str(e).split()) or type(e).__name__)


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def compression_mode(text: str) -> str:
    """``auto``, ``on``, ``off``, or an existing JSON settings file."""
    if text in MODES or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: use auto, on, off or a JSON settings file (no such file)")


def data_source(text: str) -> str:
    """A local path (which must exist), a glob, ``stdlib``, or a datasets name."""
    from ..data.loader import looks_local

    path = os.path.expanduser(text)
    if looks_local(path) and not (os.path.exists(path) or any(c in path for c in "*?[")):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file or folder (a local .txt/.jsonl/.json/.parquet "
                                         "file, a folder or glob of them, or a datasets name)")
    return text


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{value} is not a number > 0")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number >= 0")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def build_parser(family: str, description: str) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="tiny", choices=list(FAMILY_PRESETS[family]), help="model size")
    par = p.add_argument_group("parallelism (unset sizes: from accelerate launch's parallelism_config, TACO_PP_SIZE "
                               "and the number of processes)")
    par.add_argument("--tp", type=positive_int, help="tensor-parallel size (default: the launch config's; one "
                     "process without one: 2, emulated in that process)")
    par.add_argument("--pp", type=positive_int, help="pipeline stages (default: what dp x tp leave of the processes)")
    par.add_argument("--dp", type=positive_int, help="data-parallel replicas (default: the launch config's "
                     "dp_replicate_size or dp_shard_size, else 1)")
    par.add_argument("--dp-mode", choices=("ddp", "fsdp"), help="replicas averaging gradients, or FSDP2 (default: "
                     "fsdp when the launch config sets dp_shard_size, else ddp)")
    par.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    par.add_argument("--stages-per-rank", type=positive_int, help="virtual stages per pp rank (default: 2 for "
                     "interleaved_1f1b, else 1)")
    par.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism in TP")
    add_compression_args(p, small="nano/tiny")
    d = p.add_argument_group("data")
    d.add_argument("--data", type=data_source, help="datasets name[:config], or local .txt/.jsonl/.parquet files "
                   "(default: the shipped stdlib corpus)")
    d.add_argument("--text-field", default="text", help="record field holding the text")
    d.add_argument("--tokenizer", default="byte", help="byte, bpe:N (trained and cached), or a local tokenizer folder")
    d.add_argument("--seq-len", type=positive_int, default=128, help="tokens per training window")
    d.add_argument("--micro-batch-size", type=positive_int, default=4, help="windows per micro-batch and dp replica")
    d.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches per step (gradient "
                   "accumulation; the pipeline's micro-batches)")
    add_optimisation_args(p, steps=200, lr=3e-3, warmup=20, weight_decay=0.1)
    r = p.add_argument_group("evaluation, logging, checkpoints")
    r.add_argument("--eval-every", type=non_negative_int, default=50, help="validation every N steps (0: at the end only)")
    r.add_argument("--eval-batches", type=positive_int, default=4, help="validation batches")
    r.add_argument("--log-every", type=positive_int, default=10, help="a log line every N steps")
    r.add_argument("--output-dir", default=f"runs/{family}_pretrain", help="history, plots, checkpoints, export")
    r.add_argument("--trackers", default="tensorboard", help="comma-separated Accelerate trackers, or 'none'")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--save-every", type=non_negative_int, default=0, help="checkpoint every N steps (0: never)")
    r.add_argument("--resume", help="'latest' (the newest undamaged one under OUTPUT_DIR/checkpoints) or a step_N "
                   "folder (default: start from scratch)")
    r.add_argument("--no-export", action="store_true", help="skip the final transformers export")
    r.add_argument("--no-plot", action="store_true", help="no loss-curve PNG")
    r.add_argument("--cache-dir", help="tokenizer and token cache (default: OUTPUT_DIR/cache)")
    r.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, unless the launch "
                   "says to use the CPU (--cpu, use_cpu: true); cpu: gloo on a GPU machine")
    add_timeout_arg(r)
    return p


def add_timeout_arg(group) -> None:
    group.add_argument("--timeout", type=positive_float, help="seconds a collective waits for a stalled peer before "
                       "the run fails (default: TACO_TIMEOUT_S, else 600)")


def add_compression_args(p: argparse.ArgumentParser, small: str) -> None:
    """--compression, --group-size, --compression-threshold (``small``: the models that compress
    every message by default, for the help text)."""
    c = p.add_argument_group("TACO compression of the TP collectives")
    c.add_argument("--compression", type=compression_mode, help=f"auto (each communication site compressed where timing on the real group "
                   "says it pays), on (every message), off, or a JSON settings file (TacoConfig fields, or "
                   "{'mode': 'auto'|'on'|'off', 'forward': {...}|null, 'backward': {...}|null, "
                   "'sites': {pattern: {...}|null}, 'threshold_bytes': n, 'piece_bytes': n}: "
                   "taco_accel.Compression.from_json) "
                   f"(default: auto; on for {small}, which exist to show TACO's numerics)")
    c.add_argument("--group-size", type=positive_int, help="codec group size G of every setting (default: the "
                   "--compression value's, 128 unless a file says otherwise, lowered to the hidden size below 128: "
                   "taco_accel.Compression.fit)")
    c.add_argument("--compression-threshold", type=non_negative_int,
                   help="Compression.threshold_bytes: bytes below which a collective stays plain without timing "
                   "(default: 0, every message may compress)")
    c.add_argument("--grad-compression", type=compression_mode, default="off",
                   help="the data-parallel gradient reduction (DDP average, FSDP2 reduce-scatter): off, on (FP8 with "
                   "error feedback: 4 bytes of fp32 residual per local gradient value), auto, or a JSON settings "
                   "file as for --compression (its 'backward' settings apply; sites dp.grad.*); --group-size and "
                   "--compression-threshold do not apply to it")


def add_optimisation_args(p: argparse.ArgumentParser, *, steps: int, lr: float | None, warmup: int,
                          weight_decay: float, lr_help: str | None = None) -> None:
    """The optimisation flags both recipes share, with the recipe's defaults."""
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps")
    o.add_argument("--lr", type=positive_float, default=lr, help=lr_help or "peak learning rate (AdamW)")
    o.add_argument("--min-lr-ratio", type=non_negative_float, default=0.1, help="final learning rate / peak (cosine)")
    o.add_argument("--warmup", type=non_negative_int, default=warmup, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=non_negative_float, default=weight_decay, help="AdamW weight decay")
    o.add_argument("--max-grad-norm", type=non_negative_float, default=1.0, help="clip the gradient norm (0: no clipping)")
    o.add_argument("--mixed-precision", choices=MIXED_PRECISION, help="default: bf16 on GPUs, no on CPU")
    o.add_argument("--seed", type=int, default=0, help="initial weights, data order and dropout")
    add_speed_args(p)


def add_speed_args(p: argparse.ArgumentParser) -> None:
    """--compile / --no-compile, --compile-backend, --activation-checkpointing."""
    s = p.add_argument_group("speed and memory")
    s.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each decoder block (default: on with CUDA, off on the CPU)")
    s.add_argument("--compile-backend", default="inductor", help="torch.compile backend (Accelerate's "
                   "dynamo_backend names: inductor, aot_eager, eager, ...)")
    s.add_argument("--activation-checkpointing", "--gradient-checkpointing", dest="activation_checkpointing",
                   action="store_true", help="recompute each decoder layer's activations in backward (less "
                   "memory, about a third more compute)")


def mixed_precision_from_args(args) -> str:
    """--mixed-precision, else bf16 on a GPU run and no on the CPU."""
    return args.mixed_precision or ("bf16" if device_type(args.device) == "cuda" else "no")


def trackers_from_args(args) -> tuple:
    return () if args.trackers == "none" else tuple(t for t in args.trackers.split(",") if t)


def setup_logging() -> None:
    """INFO on global rank 0, warnings elsewhere."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def compression_from_args(args, hidden_size: int, small: bool | None = None) -> Compression:
    """The run's `Compression`, each flag mapped onto one of its fields or methods and nothing
    else: --compression is `Compression.resolve` of the value, --compression-threshold its
    ``threshold_bytes``, --group-size the group size of every setting it holds; without
    --group-size, `Compression.fit` to the model's ``hidden_size`` (the one fitting rule: it
    changes nothing from a hidden size of 128 on, and is logged where it does).

    ``small``: a tiny model (default: whether ``args.preset`` is a small preset), whose default
    is ``"on"`` rather than `DEFAULT_MODE`: its messages are far below any size where the codec
    pays, and it exists to show the numerics."""
    small = small if small is not None else args.preset in SMALL_PRESETS
    compression = Compression.resolve(args.compression or ("on" if small else DEFAULT_MODE))
    if args.compression_threshold is not None:
        compression = compression.replace(threshold_bytes=args.compression_threshold)
    if args.group_size:
        return compression.map_configs(lambda config: config.replace(group_size=args.group_size))
    fitted = compression.fit(hidden_size)
    if fitted != compression:
        logger.info("compression: group sizes fitted to the hidden size %d (Compression.fit; --group-size sets "
                    "them): %s", hidden_size, fitted)
    return fitted


def default_tp(args) -> int | None:
    """--tp, else 2 for a small preset in a single process with no sizes from the launch (so
    that a laptop run still shows TACO: emulated tensor parallelism), else None (the launch's)."""
    if args.tp is not None:
        return args.tp
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1 and args.pp is None and args.dp is None
    from_launch = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    return 2 if single and not from_launch and args.preset in SMALL_PRESETS else None


def config_from_args(family: str, args) -> TrainConfig:
    preset = FAMILY_PRESETS[family][args.preset]
    hidden = preset.get("hidden_size", preset.get("n_embd"))
    return TrainConfig(
        family=family, preset=args.preset, pp=args.pp, dp=args.dp, tp=default_tp(args), dp_mode=args.dp_mode,
        schedule=args.schedule, stages_per_rank=args.stages_per_rank, sequence_parallel=args.sequence_parallel,
        compression=compression_from_args(args, hidden), grad_compression=args.grad_compression,
        data=args.data, text_field=args.text_field,
        tokenizer=args.tokenizer, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, steps=args.steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        mixed_precision=mixed_precision_from_args(args), seed=args.seed, compile=args.compile,
        compile_backend=args.compile_backend, activation_checkpointing=args.activation_checkpointing,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
        output_dir=args.output_dir,
        trackers=trackers_from_args(args), progress=not args.no_progress, save_every=args.save_every, resume=args.resume, export=not args.no_export,
        plot=not args.no_plot, cache_dir=args.cache_dir, device=args.device, timeout_s=args.timeout,
    )


def main(family: str, description: str, argv=None) -> list[dict]:
    """Parse the command line, train, return the history (on every rank)."""
    parser = build_parser(family, description)
    args = parser.parse_args(argv)
    setup_logging()
    if args.compression is None and args.preset in SMALL_PRESETS:
        logger.info("the %s preset compresses every TP message (--compression on): it exists to show TACO's "
                    "numerics; its messages are far too small for the codec to pay (--compression auto lets "
                    "timing decide)", args.preset)
    with usage_errors(parser):
        trainer = Trainer(config_from_args(family, args))
        trainer.check_output_folder()
    history = trainer.train()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return history
