"""The pretraining loop of the recipes, on the same `Accelerator` as a user's own loop.

Read top to bottom, picotron style:

1. `Trainer.__init__`: a `taco_accel.Accelerator` for the mesh sizes of `TrainConfig` or
   ``accelerate launch`` (one process with tp > 1 emulates TP); tokenizer and packed data
   (rank 0 first, the others read its cache); the model from a config, built on every rank
   with the same seed; ``accelerator.prepare_pipeline`` (tp, then this rank's pipeline stages,
   then dp; with pp=1: one stage, gradient accumulation over the micro-batches);
   one AdamW over this rank's parameters and its LR schedule, prepared.
2. `Trainer.train_step`: one optimizer step. The schedule runs forward and backward of every
   micro-batch (loss on the last stage); ``accelerator.clip_grad_norm_`` finishes the
   gradients (averaged over dp, tied embeddings summed across stages) and clips them by their
   norm over the whole mesh; AdamW and the schedule step. Loss and communication statistics
   reach every rank in one all-reduce.
3. `Trainer.train` is the one loop (`TrainingLoop`): evaluation every N steps, tracker
   logging, a progress bar, checkpoints (``accelerator.save_state``), at the end the history and
   the compression decisions; `Trainer.finish` adds a loss-curve PNG and the transformers export.

The global batch is ``micro_batch_size * micro_batches * dp`` windows of ``seq_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from ..comm.policy import DEFAULT_COMPRESSION, Compression, CompressionLike
from ..parallel import (SCHEDULES, ParallelDims, collective_timeout, compile_backend, enable_activation_checkpointing,
                        export_pretrained)
from ..integrations import Accelerator
from ..parallel.transfer import host_numbers
from .ranks import global_rank, main_first, usable_trackers
from .loop import TrainingLoop, comm_fields, comm_text, comm_totals, lr_lambda
from .metrics import flops_per_token, plot_losses
from .presets import model_config, pad_vocab

logger = logging.getLogger(__name__)

MIXED_PRECISION = ("no", "bf16")


@dataclass
class TrainConfig:
    """Everything a pretraining run needs; the recipes fill it from argparse.

    Mesh sizes left as None come from ``accelerate launch`` (`ParallelDims.from_env`).
    ``compression``: any form `taco_accel.Compression.resolve` takes (default ``"auto"``),
    resolved when the config is built; ``grad_compression`` the same for the data-parallel
    gradient reduction (default ``"off"``; `taco_accel.Accelerator`'s argument). ``data: what
    `load_texts` reads, or several such sources. ``output_dir=None``: a run that writes nothing
    (its history is what `Trainer.train` returns), without checkpoints, export or plot.
    """

    family: str = "qwen2"
    preset: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    # parallelism
    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    dp_mode: str | None = None
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    sequence_parallel: bool = False
    compression: CompressionLike = DEFAULT_COMPRESSION  # a taco_accel.Compression once built
    grad_compression: CompressionLike = "off"  # the dp gradient reduction's, a Compression once built
    # data
    data: str | tuple[str, ...] | None = None
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 128
    micro_batch_size: int = 4
    micro_batches: int = 2
    # optimisation
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    compile: bool | None = None  # torch.compile of the stages; None: on with CUDA, off on the CPU
    compile_backend: str = "inductor"
    activation_checkpointing: bool = False  # recompute each decoder layer's forward in backward
    seed: int = 0
    # evaluation, logging, output
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    output_dir: str | None = "runs/pretrain"
    trackers: tuple = ("tensorboard",)
    progress: bool = True
    save_every: int = 0
    resume: str | None = None
    export: bool = True
    plot: bool = True
    cache_dir: str | None = None
    device: str | None = None  # "cpu" forces the CPU (gloo) on a GPU machine; None: `device_type`
    timeout_s: float | None = None  # a collective waiting longer fails; None: TACO_TIMEOUT_S, else 600

    def __post_init__(self) -> None:
        self.compression = Compression.resolve(self.compression)
        self.grad_compression = Compression.resolve(self.grad_compression)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not supported; use one of {SCHEDULES}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: use one of {MIXED_PRECISION}")
        for name in ("seq_len", "micro_batch_size", "micro_batches", "steps", "eval_batches", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        for name in ("save_every", "eval_every", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr={self.lr} must be > 0 and min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if self.output_dir is None and (self.save_every or self.resume or self.export or self.plot or self.trackers):
            raise ValueError(f"output_dir=None writes nothing, but save_every={self.save_every}, resume={self.resume!r}, "
                             f"export={self.export}, plot={self.plot}, trackers={self.trackers!r} ask for files: name "
                             "an output_dir, or set save_every=0, resume=None, export=False, plot=False, trackers=()")
        check_compile_backend(self.compile_backend)
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if self.schedule == "interleaved_1f1b" else 1

    def to_dict(self) -> dict:
        return config_dict(self)


def check_compile_backend(backend: str) -> None:
    """A ValueError unless ``backend`` is one Accelerate's ``dynamo_backend`` takes."""
    from accelerate.utils import DynamoBackend

    names = [b.value.lower() for b in DynamoBackend if b.value != "NO"]
    if not isinstance(backend, str) or backend.lower() not in names:
        raise ValueError(f"compile_backend={backend!r}: use one of {names} (inductor for speed, aot_eager to debug)")


def fused_adamw(params) -> dict:
    """``{"fused": True}`` (AdamW's one-kernel CUDA step) when every parameter is a plain CUDA
    floating-point tensor, else ``{}`` (the foreach step: CPU runs, FSDP2's DTensor shards)."""
    params = list(params)
    plain = all(type(p) is torch.nn.Parameter and p.is_cuda and p.is_floating_point() for p in params)
    return {"fused": True} if params and plain else {}


def device_type(device: str | None) -> str:
    """The device type a run's ``device`` setting gives (None: cuda when available, unless Accelerate is
    told to use the CPU, ``ACCELERATE_USE_CPU``, as ``accelerate launch --cpu`` or a config's
    ``use_cpu: true`` sets it: the device the run's Accelerator then takes)."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU") else "cpu"


def config_dict(cfg) -> dict:
    """A run config (a dataclass with ``compression`` and ``grad_compression`` fields) as
    JSON-ready values."""
    out = dataclasses.asdict(cfg)
    out["compression"] = cfg.compression.to_dict()
    out["grad_compression"] = cfg.grad_compression.to_dict()
    return out


class Trainer(TrainingLoop):
    """Builds a parallel run from a `TrainConfig`; `train()` (the one loop, `TrainingLoop`) runs
    it and returns the history. ``model`` is the transformers model (with pipeline stages: the
    layers this rank holds); a subclass may supply the tokens (`load_tokens`), e.g. one data set
    shared by several runs of a process."""

    run_name = "pretrain"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir) if cfg.output_dir is not None else None
        self.trackers = usable_trackers(cfg.trackers) if global_rank() == 0 else []
        self.accelerator = acc = Accelerator(
            parallel_dims=requested_dims(cfg.pp, cfg.dp, cfg.tp, cfg.dp_mode), mixed_precision=cfg.mixed_precision,
            cpu=cfg.device == "cpu", project_dir=cfg.output_dir, compression=cfg.compression,
            grad_compression=cfg.grad_compression, sequence_parallel=cfg.sequence_parallel,
            step_scheduler_with_optimizer=False,
            log_with=self.trackers or None, kwargs_handlers=[timeout_handler(cfg.timeout_s)],
            logits="none",  # the pipeline's loss: the head and loss fused, no logits
            dynamo_backend=(compile_backend(cfg.compile, device_type(cfg.device)) and cfg.compile_backend) or "no",
        )
        self.dims, self.mesh, self.device = acc.parallel_dims, acc.torch_device_mesh, acc.device
        self.coords = {name: self.mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self.step, self.history = 0, []
        acc.register_for_checkpointing(self.batches, self)
        if cfg.resume:
            self.resume(cfg.resume)

    # -- construction -----------------------------------------------------------------------
    def load_tokens(self) -> tuple:
        """``(tokenizer, training tokens, validation tokens)`` of ``cfg.data`` (`pretraining_tokens`):
        rank 0 trains the tokenizer and fills the caches, the others read them."""
        cfg = self.cfg
        cache = cfg.cache_dir or (self.out / "cache" if self.out is not None else None)
        return main_first(lambda: pretraining_tokens(cfg.data, cfg.tokenizer, cache, cfg.text_field))

    def _build_data(self) -> None:
        from ..data import PackedBatches, eval_batches

        cfg = self.cfg
        self.tokenizer, train_tokens, val_tokens = self.load_tokens()
        dp, dp_rank = self.dims.dp, self.coords["dp"]
        self.local_batch = cfg.micro_batch_size * cfg.micro_batches
        self.global_batch = self.local_batch * dp
        self.batches = PackedBatches(train_tokens, cfg.seq_len, self.global_batch, dp_rank, dp, seed=cfg.seed)
        self.val = eval_batches(val_tokens, cfg.seq_len, self.global_batch, cfg.eval_batches, dp_rank, dp)
        logger.info("data: %d training tokens, %d validation tokens, vocabulary %d", train_tokens.numel(),
                    val_tokens.numel(), len(self.tokenizer))

    def _build_model(self) -> None:
        from transformers import AutoModelForCausalLM

        from ..parallel.pipeline import is_tied

        cfg = self.cfg
        overrides = {"vocab_size": pad_vocab(len(self.tokenizer)), **cfg.model_overrides}  # e.g. a real vocabulary
        self.model_config = model_config(cfg.family, cfg.preset, max_positions=cfg.seq_len, **overrides)
        torch.manual_seed(cfg.seed)  # every rank builds the same initial model
        self.model = model = AutoModelForCausalLM.from_config(self.model_config)
        num_params = sum(p.numel() for p in model.parameters())  # a tied head counts once
        embed_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
        head_params = model.lm_head.weight.numel() if is_tied(model) else 0  # the head is a matmul: it counts
        self.num_params = num_params
        self.flops_per_token = flops_per_token(self.model_config, num_params + head_params, embed_params, cfg.seq_len)
        if cfg.activation_checkpointing:  # before the stages are built and compiled
            enable_activation_checkpointing(model)
        # tp on the whole model, then this rank's stages, then dp; keys and site names stay global
        self.pipe = self.accelerator.prepare_pipeline(
            model, micro_batches=cfg.micro_batches, schedule=cfg.schedule, stages_per_rank=cfg.stages_per_rank,
            seq_len=cfg.seq_len, shifted_labels=True)
        self.parts = self.pipe.parts
        self.params = list(self.parts.parameters())
        if self.is_main:
            logger.info("model %s/%s: %.1fM parameters, mesh %s, schedule %s", cfg.family, cfg.preset, num_params / 1e6,
                        self.dims, cfg.schedule)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        fused = fused_adamw(self.params)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **fused,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.optimizer, self.scheduler = self.accelerator.prepare(optimizer, scheduler)

    # -- one step ---------------------------------------------------------------------------
    def _reduce(self, loss: torch.Tensor, *extra: float, same: torch.Tensor | None = None) -> list[float]:
        """Global mean loss and summed extras, on every rank, in one all-reduce and one host
        transfer (which also waits for the step's device work); ``same``: a 0-d tensor every
        rank already holds the global value of (the gradient norm), read in that transfer, last,
        with the step's wire-header check (`Accelerator.read_with_wire_check`)."""
        counts = self.parts.has_last_stage and self.coords["tp"] == 0
        mine = loss / self.dims.dp if counts else torch.zeros_like(loss)
        values = torch.cat([mine.view(1), host_numbers(extra, self.device)])
        dist.all_reduce(values)
        if same is None:
            return values.tolist()
        return self.accelerator.read_with_wire_check(torch.cat([values, same.detach().to(values).view(1)]))

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; returns its metrics (on every rank)."""
        cfg, acc = self.cfg, self.accelerator
        start = time.perf_counter()
        inputs, labels = self.batches.batch(self.step)
        loss = self.pipe.step(inputs, labels)  # in the accelerator's autocast (prepare_pipeline's runner)
        grad_norm = acc.clip_grad_norm_(self.params, cfg.max_grad_norm)
        # read with the loss and the wire check, before the optimizer uses the step: one host sync a step
        loss, *traffic, grad_norm = self._reduce(loss, *comm_totals(self.parts.ledgers()), same=grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # freed here, as a plain loop does, not held to the next step
        self.scheduler.step()
        self.step += 1
        self.batches.step = self.step
        seconds = time.perf_counter() - start
        tokens = self.global_batch * cfg.seq_len
        return {
            "step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": seconds,
            "tokens_per_s": tokens / seconds,
            "tflops_per_device": self.flops_per_token * tokens / seconds / self.dims.world_size / 1e12,
            **comm_fields(traffic),
        }

    def evaluate(self) -> dict:
        """``{"val_loss": mean loss over the fixed validation batches}`` (a collective)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in self.val:
            total += self.pipe.eval(inputs, labels)
        comm_totals(self.parts.ledgers())  # evaluation traffic is not part of the training step figures
        return {"val_loss": self._reduce(total / len(self.val))[0]}  # one collective and one host sync

    # -- the end of a run ---------------------------------------------------------------------
    def finish(self) -> None:
        cfg = self.cfg
        if self.is_main:
            if cfg.plot and self.out is not None and plot_losses(self.history, self.out / "loss.png",
                                       f"{cfg.family}/{cfg.preset} {self.dims}, TACO {cfg.compression}"):
                logger.info("loss curve: %s", self.out / "loss.png")
        if cfg.export:
            export_pretrained(self.parts.modules, self.mesh, self.model_config, self.out / "final",
                              tokenizer=self.tokenizer, drop=self.parts.export_drop)

    def format_row(self, row: dict) -> str:
        text = f"{self.format_head(row)} {row['tokens_per_s']:.0f} tok/s {row['tflops_per_device']:.3f} TFLOPS/device"
        text += comm_text(row)
        if "val_loss" in row:
            text += f" val_loss {row['val_loss']:.4f}"
        return text


def pretraining_tokens(data, tokenizer: str, cache_dir, text_field: str = "text") -> tuple:
    """``(tokenizer, training tokens, validation tokens)``: the documents of ``data`` (a source
    `load_texts` reads, several of them, or None: the shipped corpus), every 20th held out
    (`split_documents`), the tokenizer ``tokenizer`` ("byte", "bpe:N" trained on the training
    documents, or a folder) and both token streams, cached in ``cache_dir`` (None: no cache)."""
    from ..data import build_tokenizer, load_texts, split_documents, tokenize

    sources = tuple(data) if isinstance(data, (list, tuple)) else (data,)
    docs = [doc for source in sources or (None,) for doc in load_texts(source, text_field=text_field)]
    train_docs, val_docs = split_documents(docs)
    tok = build_tokenizer(tokenizer, train_docs, cache_dir)
    return tok, tokenize(train_docs, tok, cache_dir), tokenize(val_docs, tok, cache_dir)


def timeout_handler(seconds: float | None):
    """Accelerate's way to say how long a collective may wait (`collective_timeout`)."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=collective_timeout(seconds))


def requested_dims(pp, dp, tp, dp_mode) -> ParallelDims:
    """The mesh sizes asked for: explicit values, then ``accelerate launch``'s environment.
    One process asking for tp > 1 gets it unchecked (the Accelerator emulates it)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and (tp or 1) > 1:
        return ParallelDims(pp=pp or 1, dp=dp or 1, tp=tp, dp_mode=dp_mode or "ddp")
    return ParallelDims.from_env(world, pp=pp, dp=dp, tp=tp, dp_mode=dp_mode)
