"""Fine-tuning a transformers checkpoint with TP (TACO-compressed) x DP: full or LoRA, then export.

Read top to bottom:

1. `Finetuner.__init__`: a `taco_accel.Accelerator` for the ("pp"=1, "dp", "tp") mesh of
   `FinetuneConfig` or ``accelerate launch``; the checkpoint (a local folder, a hub name, or ``"tiny"``: a small random model of
   ``family`` written on the spot); its tokenizer; the records, formatted (chat template or plain
   text) and tokenized with the loss on the response tokens only, some held out; the model read
   straight into its TP slices (`taco_accel.from_pretrained`); LoRA through peft on the parallel
   layers (`get_peft_model`) or every parameter trainable; ``accelerator.prepare`` of the model
   (data parallelism), then of AdamW on what trains and its schedule.
2. `Finetuner.train_step`: one optimizer step over ``micro_batches`` padded micro-batches, each
   forward in the accelerator's autocast (``prepare`` wraps the model's forward in it, as for a
   user's own loop: the one precision rule of every entry point); the loss is the mean over the
   response tokens of the whole global batch (``num_items_in_batch``);
   ``accelerator.clip_grad_norm_`` averages the gradients over dp and clips them by their norm
   over the mesh. ``--save-every`` / ``--resume`` checkpoint through ``accelerator.save_state``.
3. `Finetuner.evaluate`: per held-out sequence, the summed negative log-likelihood of its
   scored tokens, reduced to a perplexity by the local `evaluate` metric `token_perplexity`
   (no hub); recorded in the history, the trackers and ``eval_results.json``.
4. `Finetuner.train` then exports: LoRA writes ``adapter/`` (peft format, full shapes: plain
   peft loads it on the original model) and ``merged/`` (the adapter merged in, a plain
   transformers checkpoint); full fine-tuning writes ``final/``. Each with the tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.policy import DEFAULT_COMPRESSION, Compression, CompressionLike
from ..data.loader import load_records
from ..data.supervised import IGNORE, RecordFields, SFTBatches, eval_micro_batches, split_examples, \
    tokenize_records
from ..models import from_pretrained, save_pretrained
from ..models.state import tp_replicas
from ..models.loss import logits_mode, token_losses
from ..integrations import Accelerator, export_merged, get_peft_model, save_adapter
from ..parallel.transfer import host_numbers, to_device
from ..parallel import compile_backend, enable_activation_checkpointing
from .ranks import global_rank, main_first, usable_trackers
from .metrics import plot_losses
from .loop import TrainingLoop, comm_fields, comm_text, comm_totals, lr_lambda
from .trainer import (MIXED_PRECISION, check_compile_backend, config_dict, device_type, fused_adamw, requested_dims,
                      timeout_handler)

logger = logging.getLogger(__name__)

METHODS = ("lora", "full")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TINY = "tiny"
TINY_VOCAB = 384  # the byte tokenizer's 257 tokens, padded to a multiple of 128


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run needs; the recipes fill it from argparse.

    ``model``: a local checkpoint folder, a hub name, or ``"tiny"`` (a random tiny model of
    ``family`` with a byte tokenizer, for smoke tests). Mesh sizes left as None come from
    ``accelerate launch``. ``compression=None`` runs the TP collectives uncompressed;
    ``grad_compression`` compresses the data-parallel gradient reduction (default ``"off"``).
    """

    model: str = TINY
    family: str = "qwen2"  # only for model="tiny"
    method: str = "lora"
    # LoRA
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    # parallelism
    tp: int | None = None
    dp: int | None = None
    sequence_parallel: bool = False
    compression: CompressionLike = DEFAULT_COMPRESSION  # a taco_accel.Compression once built
    grad_compression: CompressionLike = "off"  # the dp gradient reduction's, a Compression once built
    # data
    data: str | None = None
    eval_data: str | None = None
    split: str = "train"
    eval_split: str | None = None
    format: str = "auto"
    prompt_field: str | None = None
    response_field: str | None = None
    text_field: str = "text"
    messages_field: str = "messages"
    system_prompt: str | None = None
    tokenizer: str | None = None  # default: the checkpoint's
    max_len: int = 512
    eval_fraction: float = 0.05
    max_eval_examples: int = 256
    micro_batch_size: int = 4
    micro_batches: int = 1
    # optimisation
    steps: int = 100
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    dtype: str = "auto"
    activation_checkpointing: bool = False  # recompute each decoder layer's forward in backward
    compile: bool | None = None  # torch.compile of the model; None: on with CUDA, off on the CPU
    compile_backend: str = "inductor"
    seed: int = 0
    # evaluation, logging, output
    eval_every: int = 50
    log_every: int = 10
    output_dir: str = "runs/finetune"
    trackers: tuple = ("tensorboard",)
    progress: bool = True
    export: bool = True
    merge: bool = True
    plot: bool = True
    save_every: int = 0
    resume: str | None = None
    device: str | None = None
    timeout_s: float | None = None  # a collective waiting longer fails; None: TACO_TIMEOUT_S, else 600

    def __post_init__(self) -> None:
        self.compression = Compression.resolve(self.compression)
        self.grad_compression = Compression.resolve(self.grad_compression)
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: use one of {METHODS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {DTYPES}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: use one of {MIXED_PRECISION}")
        if self.data is None:
            raise ValueError("data=None: pass --data (a datasets name or local .jsonl/.json/.txt files)")
        for name in ("max_len", "micro_batch_size", "micro_batches", "steps", "lora_r"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in [0, 1)")
        for name in ("save_every", "eval_every", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        check_compile_backend(self.compile_backend)

    def to_dict(self) -> dict:
        return config_dict(self)


def tiny_checkpoint(family: str, path: str | os.PathLike, max_len: int, seed: int = 0) -> None:
    """Write a random tiny causal LM of ``family`` (qwen2, qwen3, llama, mistral, gpt2) with a byte
    tokenizer to ``path``: a stand-in for a hub checkpoint when there is no network."""
    from ..data import build_tokenizer
    from ..models.tiny import tiny_model

    positions = "n_positions" if family == "gpt2" else "max_position_embeddings"
    model = tiny_model(family, seed=seed, vocab_size=TINY_VOCAB, **{positions: max(max_len, 64)})
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 0  # <|endoftext|>
    model.save_pretrained(path)
    build_tokenizer("byte").save_pretrained(path)
    logger.info("wrote a random tiny %s to %s", type(model).__name__, path)


def resolve_checkpoint(name: str) -> str:
    """A local folder for ``name``: itself, or a hub snapshot (downloaded once, on the first rank)."""
    if os.path.isdir(name):
        return name
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
    return snapshot_download(name, allow_patterns=patterns)


class Finetuner(TrainingLoop):
    """Builds a fine-tuning run from a `FinetuneConfig`; `train()` (the one loop, `TrainingLoop`)
    runs it and returns the history."""

    run_name = "finetune"

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.trackers = usable_trackers(cfg.trackers) if global_rank() == 0 else []
        self.accelerator = acc = Accelerator(
            parallel_dims=requested_dims(1, cfg.dp, cfg.tp, "ddp"), mixed_precision=cfg.mixed_precision,
            cpu=cfg.device == "cpu", project_dir=str(self.out), compression=cfg.compression,
            grad_compression=cfg.grad_compression, sequence_parallel=cfg.sequence_parallel,
            step_scheduler_with_optimizer=False,
            log_with=self.trackers or None, kwargs_handlers=[timeout_handler(cfg.timeout_s)],
            logits="none",  # training uses the loss alone: the head and loss fused, no logits
            dynamo_backend=(compile_backend(cfg.compile, device_type(cfg.device)) and cfg.compile_backend) or "no",
        )
        if acc.emulated_tp > 1:
            raise ValueError(f"tp={acc.emulated_tp} on one process: fine-tuning reads real TP shards; launch "
                             f"{acc.emulated_tp} processes (accelerate launch --multi_gpu --num_processes "
                             f"{acc.emulated_tp}) or leave --tp unset")
        self.dims, self.mesh, self.device = acc.parallel_dims, acc.torch_device_mesh, acc.device
        self.rank, self.is_main = dist.get_rank(), dist.get_rank() == 0
        self.tp_rank, self.dp_rank = acc.tensor_parallel_rank, acc.data_parallel_rank
        self.path = main_first(self._checkpoint)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or self.path)
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self.step, self.history, self.eval_results = 0, [], {}
        acc.register_for_checkpointing(self)
        if cfg.resume:
            self.resume(cfg.resume)

    def _checkpoint(self) -> str:
        if self.cfg.model != TINY:
            return resolve_checkpoint(self.cfg.model)
        path = self.out / "base"
        if self.is_main and not (path / "config.json").exists():
            tiny_checkpoint(self.cfg.family, path, self.cfg.max_len, self.cfg.seed)
        return str(path)

    # -- construction -----------------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, tok = self.cfg, self.tokenizer
        fields = RecordFields(cfg.prompt_field, cfg.response_field, cfg.messages_field, cfg.text_field,
                              cfg.system_prompt)

        def examples(source, split):
            return tokenize_records(load_records(source, split=split), tok, fmt=cfg.format, max_len=cfg.max_len,
                                    fields=fields, warn=self.is_main)

        train = main_first(lambda: examples(cfg.data, cfg.split))
        if cfg.eval_data or cfg.eval_split:
            held = main_first(lambda: examples(cfg.eval_data or cfg.data, cfg.eval_split or cfg.split))
        else:
            train, held = split_examples(train, cfg.eval_fraction)
        held = held[:cfg.max_eval_examples]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        multiple = self.dims.tp if cfg.sequence_parallel else 1
        dp, dp_rank = self.dims.dp, self.dp_rank
        self.batches = SFTBatches(train, cfg.micro_batch_size, cfg.micro_batches, pad, dp_rank=dp_rank, dp_size=dp,
                                  seed=cfg.seed, pad_multiple=multiple)
        self.val = eval_micro_batches(held, cfg.micro_batch_size, pad, dp_rank=dp_rank, dp_size=dp,
                                      pad_multiple=multiple)
        scored = sum(sum(label != IGNORE for label in labels) for _, labels in train)
        logger.info("data: %d training examples (%d scored tokens), %d held out", len(train), scored, len(held))

    def _dtype(self) -> torch.dtype | None:
        if self.cfg.dtype != "auto":
            return getattr(torch, self.cfg.dtype)
        if self.cfg.method == "lora" and self.device.type == "cuda":
            return None  # the checkpoint's own (frozen base weights)
        return torch.float32  # master weights of full fine-tuning, and CPU runs

    def _build_model(self) -> None:
        cfg = self.cfg
        model = from_pretrained(self.path, compression=cfg.compression, sequence_parallel=cfg.sequence_parallel,
                                device_mesh=self.mesh["tp"], dtype=self._dtype(), device=self.device)
        positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if positions is not None and cfg.max_len > positions:
            raise ValueError(f"max_len={cfg.max_len} is beyond the model's {positions} positions; use --max-len "
                             f"{positions} or less")
        if len(self.tokenizer) > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary is "
                             f"{model.config.vocab_size}; use the checkpoint's own tokenizer")
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        if cfg.method == "lora":
            from peft import LoraConfig

            targets = cfg.target_modules
            torch.manual_seed(cfg.seed)  # the adapter's initial draw (broadcast over tp anyway)
            model = get_peft_model(model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, task_type="CAUSAL_LM",
                target_modules=targets if isinstance(targets, str) else list(targets)))
            model.peft_config["default"].base_model_name_or_path = cfg.model if cfg.model != TINY else self.path
        torch.manual_seed(cfg.seed + 1 + self.dp_rank)  # dropout: the same within a tp group, not across dp
        replicas = tp_replicas(model, self.dims.tp)
        self.model = self.accelerator.prepare(model)  # data parallelism over dp (the tp layout is checked)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        full_size = {n: p.numel() * self.dims.tp // replicas[n] for n, p in self.model.named_parameters()}
        total = sum(full_size.values())
        trained = sum(full_size[n] for n, p in self.model.named_parameters() if p.requires_grad)
        if self.is_main:
            logger.info("%s fine-tuning of %s: %.2fM of %.2fM parameters train, mesh %s", cfg.method, cfg.model,
                        trained / 1e6, total / 1e6, self.dims)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        decay = [p for p in self.trainable if p.dim() >= 2]
        no_decay = [p for p in self.trainable if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, **fused_adamw(self.trainable),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.optimizer, self.scheduler = self.accelerator.prepare(optimizer, scheduler)

    # -- one step ---------------------------------------------------------------------------
    def _all_sum(self, values: torch.Tensor, replica_only: bool = False) -> torch.Tensor:
        """The sum over every rank of a 1-d device tensor, on the device (``replica_only``: tp rank 0
        of each replica counts, the others add 0)."""
        values = values.to(torch.float64)
        if replica_only and self.tp_rank != 0:
            values = torch.zeros_like(values)
        dist.all_reduce(values)
        return values

    def _to_device(self, batch: dict) -> dict:
        return {k: to_device(v, self.device) for k, v in batch.items()}

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; returns its metrics (on every rank), read
        from the device once, before the optimizer step."""
        start = time.perf_counter()
        micro = [self._to_device(mb) for mb in self.batches.batch(self.step)]
        scored = torch.stack([(mb["labels"][:, 1:] != IGNORE).sum() for mb in micro]).sum()
        global_tokens = self._all_sum(scored.view(1), replica_only=True)[0]
        # mean over the global batch's scored tokens, once the accelerator averages the gradients over dp
        num_items = (global_tokens.clamp(min=1.0) / self.dims.dp).float()
        losses = []
        for mb in micro:
            out = self.model(**mb, num_items_in_batch=num_items)  # in the accelerator's autocast
            out.loss.backward()
            losses.append(out.loss.detach())
        grad_norm = self.accelerator.clip_grad_norm_(self.trainable, self.cfg.max_grad_norm)  # the same on every rank
        traffic = host_numbers(comm_totals(self.accelerator.comm_ledgers(self.model)), self.device)
        summed = self._all_sum(torch.cat([(torch.stack(losses).sum() / self.dims.dp).view(1).double(), traffic]),
                               replica_only=True)
        # the step's one host read, with its wire check, before the optimizer uses the step
        loss, *traffic, grad_norm, global_tokens = self.accelerator.read_with_wire_check(
            torch.cat([summed, torch.stack([grad_norm.double(), global_tokens])]))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # freed here, as a plain loop does, not held to the next step
        self.scheduler.step()
        self.step += 1
        seconds = time.perf_counter() - start
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": seconds,
                "tokens_per_s": global_tokens / seconds, **comm_fields(traffic)}

    # -- evaluation -------------------------------------------------------------------------
    def _token_nll(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token next-token loss (b, s), 0 where not scored, from full or vocab-parallel logits."""
        shift = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        return token_losses(self.model, logits, shift, IGNORE)  # the model's own loss, token by token

    def evaluate(self) -> dict:
        """``{"eval_loss", "eval_perplexity", ...}`` of the held-out response tokens (a collective),
        also kept as ``eval_results``; see `perplexity`."""
        metrics = {f"eval_{k}": v for k, v in self._held_out().items()}
        self.eval_results = {"step": self.step, **metrics}
        return metrics

    def _held_out(self) -> dict:
        self.model.eval()
        nll, tokens = [], []
        with torch.no_grad():
            for mb in self.val:
                tokens.append((mb["labels"][..., 1:] != IGNORE).sum(-1))  # on the host already
                mb = self._to_device(mb)
                with logits_mode(self.model, "local"):
                    logits = self.model(**mb).logits  # labels given: this rank's vocabulary slice
                nll.append(self._token_nll(logits, mb["labels"]).double().sum(-1))
        if nll:  # one host transfer (a dp rank may hold no validation batch)
            nll, tokens = torch.cat(nll).tolist(), torch.cat(tokens).tolist()
        self.model.train()
        comm_totals(self.accelerator.comm_ledgers(self.model))  # evaluation traffic is not part of the training step figures
        parts = [None] * self.dims.dp
        dist.all_gather_object(parts, (nll, tokens), group=self.mesh["dp"].get_group())
        nll, tokens = [v for p in parts for v in p[0]], [v for p in parts for v in p[1]]
        result = [perplexity(nll, tokens) if self.is_main else None]
        dist.broadcast_object_list(result, src=0)
        return result[0]

    # -- the run's beginning and end ------------------------------------------------------------
    def before_training(self) -> None:
        """The held-out perplexity before any step (step 0 of the history)."""
        self.history.append(dict(self.evaluate()) | {"step": 0})

    def finish(self) -> None:
        cfg = self.cfg
        if self.is_main:
            (self.out / "eval_results.json").write_text(json.dumps(self.eval_results, indent=1))
            logger.info("held-out perplexity %.3f (loss %.4f) after %d steps", self.eval_results["eval_perplexity"],
                        self.eval_results["eval_loss"], self.eval_results["step"])
            rows = [{**r, "val_loss": r["eval_loss"]} if "eval_loss" in r else r for r in self.history]
            if cfg.plot and plot_losses(rows, self.out / "loss.png", f"{cfg.method} fine-tuning, {self.dims}"):
                logger.info("loss curve: %s", self.out / "loss.png")
        if cfg.export:
            self.export()

    def format_row(self, row: dict) -> str:
        text = f"{self.format_head(row)} {row['tokens_per_s']:.0f} scored tok/s{comm_text(row)}"
        if "eval_loss" in row:
            text += f" eval_loss {row['eval_loss']:.4f} eval_ppl {row['eval_perplexity']:.3f}"
        return text

    def extra_state(self) -> dict:
        return {"eval_results": self.eval_results}

    def load_extra_state(self, state: dict) -> None:
        self.eval_results = state["eval_results"]

    def export(self) -> None:
        """LoRA: ``adapter/`` (peft, full shapes) and ``merged/``; full: ``final/``; tokenizer in each."""
        folders = []
        if self.cfg.method == "lora":
            save_adapter(self.model, self.out / "adapter")
            folders.append(self.out / "adapter")
            if self.cfg.merge:
                self.model = export_merged(self.model, self.out / "merged")
                folders.append(self.out / "merged")
        else:
            save_pretrained(self.model, self.out / "final")
            folders.append(self.out / "final")
        if self.is_main:
            for folder in folders:
                self.tokenizer.save_pretrained(folder)
                (folder / "eval_results.json").write_text(json.dumps(self.eval_results, indent=1))
            logger.info("exported %s", ", ".join(str(f) for f in folders))


def perplexity(nll: list[float], tokens: list[int]) -> dict:
    """``{"perplexity", "loss", "tokens", ...}`` through the local `evaluate` metric `token_perplexity`
    (no hub); the same formula without evaluate where it is not installed."""
    try:
        import evaluate
    except ImportError:
        import math

        count = sum(tokens)
        return {"perplexity": math.exp(sum(nll) / count), "loss": sum(nll) / count, "tokens": int(count)}
    from .token_perplexity import MODULE_DIR

    metric = evaluate.load(MODULE_DIR, keep_in_memory=True)
    return metric.compute(nll=nll, tokens=tokens)
