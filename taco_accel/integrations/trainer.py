"""The one training loop of the recipes: mesh, pp -> tp -> dp, train, evaluate, checkpoint, export.

Read top to bottom, picotron style:

1. `Trainer.__init__`: the mesh from `TrainConfig` or ``accelerate launch``; tokenizer and
   packed data (rank 0 first, the others read its cache); the model from a config, built on
   every rank with the same seed; `apply_pp` (this rank's stages), `apply_tp` per stage,
   `apply_dp` per stage; one AdamW over this rank's parameters; a
   ``torch.distributed.pipelining`` schedule (with pp=1 too: a one-stage schedule is plain
   gradient accumulation over micro-batches).
2. `Trainer.train_step`: one optimizer step. The schedule runs forward and backward of every
   micro-batch (loss on the last stage; gradients averaged over micro-batches, then over dp),
   tied-embedding gradients are summed across stages, gradients are clipped by their norm over
   the whole mesh, then AdamW and the LR schedule step. Loss and communication statistics
   reach rank 0 in one all-reduce.
3. `Trainer.train`: the loop, evaluation every N steps, tracker logging through the
   Accelerator, a progress bar, checkpoints; at the end a loss-curve PNG and the export.

The global batch is ``micro_batch_size * micro_batches * dp`` windows of ``seq_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..codec import TacoConfig
from ..parallel import (
    SCHEDULES, DataParallelGradSync, ReplicaGradSum, TiedEmbeddingSync, apply_dp, apply_pp, apply_tp, build_mesh,
    build_schedule, clip_grad_norm_, default_device, make_pipeline_stages,
)
from ..parallel.pipeline import is_tied
from . import checkpoint as ckpt
from .accelerate import main_first, make_accelerator, parallel_dims_from_launch
from .metrics import flops_per_token, plot_losses, write_history
from .presets import model_config, pad_vocab

logger = logging.getLogger(__name__)

MIXED_PRECISION = ("no", "bf16")


@dataclass
class TrainConfig:
    """Everything a pretraining run needs; the recipes fill it from argparse.

    Mesh sizes left as None come from ``accelerate launch`` (`ParallelDims.from_env`).
    ``compression=None`` runs the TP collectives uncompressed.
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
    compression: TacoConfig | dict | None = field(default_factory=TacoConfig)
    # data
    data: str | None = None
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
    seed: int = 0
    # evaluation, logging, output
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    output_dir: str = "runs/pretrain"
    trackers: tuple = ("tensorboard",)
    progress: bool = True
    save_every: int = 0
    resume: str | None = None
    export: bool = True
    plot: bool = True
    cache_dir: str | None = None
    device: str | None = None  # "cpu" forces the CPU (gloo) on a GPU machine; None: cuda if available

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not supported; use one of {SCHEDULES}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: use one of {MIXED_PRECISION}")
        for name in ("seq_len", "micro_batch_size", "micro_batches", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if self.schedule == "interleaved_1f1b" else 1

    def to_dict(self) -> dict:
        return config_dict(self)


def config_dict(cfg) -> dict:
    """A run config (a dataclass with a ``compression`` field) as JSON-ready values."""
    out = dataclasses.asdict(cfg)
    c = cfg.compression
    out["compression"] = c.to_dict() if isinstance(c, TacoConfig) else None if c is None else {
        k: (v.to_dict() if isinstance(v, TacoConfig) else v) for k, v in c.items()}
    return out


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def _comm_totals() -> tuple[float, float]:
    """(bytes sent, bytes a plain collective would send) by this rank since the last call."""
    from ..comm import pop_comm_stats

    stats = pop_comm_stats().values()
    return float(sum(s.bytes_sent for s in stats)), float(sum(s.bytes_uncompressed for s in stats))


class Trainer:
    """Builds a parallel run from a `TrainConfig`; `train()` runs it and returns the history."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.dims = parallel_dims_from_launch(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, dp_mode=cfg.dp_mode)
        self.device = torch.device(cfg.device) if cfg.device else default_device()
        self.mesh = build_mesh(self.dims, self.device.type)
        self.coords = {name: self.mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        self.out = Path(cfg.output_dir)
        self.accelerator = make_accelerator(mixed_precision=cfg.mixed_precision, trackers=cfg.trackers if self.is_main else (),
                                            project_dir=str(self.out), cpu=self.device.type == "cpu")
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self.step, self.history = 0, []
        if cfg.resume:
            self._resume(cfg.resume)

    # -- construction -----------------------------------------------------------------------
    def _build_data(self) -> None:
        from ..data import PackedBatches, build_tokenizer, eval_batches, load_texts, split_documents, tokenize

        cfg = self.cfg
        cache = Path(cfg.cache_dir) if cfg.cache_dir else self.out / "cache"

        def load():
            train_docs, val_docs = split_documents(load_texts(cfg.data, text_field=cfg.text_field))
            tok = build_tokenizer(cfg.tokenizer, train_docs, cache)
            return tok, tokenize(train_docs, tok, cache), tokenize(val_docs, tok, cache)

        # rank 0 trains the tokenizer and fills the caches; the others read them
        self.tokenizer, train_tokens, val_tokens = main_first(load)
        dp, dp_rank = self.dims.dp, self.coords["dp"]
        self.local_batch = cfg.micro_batch_size * cfg.micro_batches
        self.global_batch = self.local_batch * dp
        self.batches = PackedBatches(train_tokens, cfg.seq_len, self.global_batch, dp_rank, dp, seed=cfg.seed)
        self.val = eval_batches(val_tokens, cfg.seq_len, self.global_batch, cfg.eval_batches, dp_rank, dp)
        logger.info("data: %d training tokens, %d validation tokens, vocabulary %d", train_tokens.numel(),
                    val_tokens.numel(), len(self.tokenizer))

    def _build_model(self) -> None:
        from transformers import AutoModelForCausalLM

        cfg, mesh = self.cfg, self.mesh
        self.model_config = model_config(cfg.family, cfg.preset, vocab_size=pad_vocab(len(self.tokenizer)),
                                         max_positions=cfg.seq_len, **cfg.model_overrides)
        torch.manual_seed(cfg.seed)  # every rank builds the same initial model
        model = AutoModelForCausalLM.from_config(self.model_config)
        tied = is_tied(model)
        num_params = sum(p.numel() for p in model.parameters())  # a tied head counts once
        embed_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
        head_params = model.lm_head.weight.numel() if tied else 0  # the head is a matmul: it counts
        self.num_params = num_params
        self.flops_per_token = flops_per_token(self.model_config, num_params + head_params, embed_params, cfg.seq_len)
        # tp first, on the whole model (parallelize wants a complete transformers model), then
        # keep this rank's stages; layer indices, keys and TP site names stay global
        replicas = apply_tp(model, mesh, cfg.compression, cfg.sequence_parallel)
        plan = apply_pp(model, mesh, cfg.stages_per_rank, seq_len=cfg.seq_len,
                        sequence_parallel=cfg.sequence_parallel and self.dims.tp > 1)
        del model
        self.plan = plan
        for stage in plan.modules:
            stage.tp_replicas = {f"model.{n}": r for n, r in replicas.items()}
            stage.to(self.device)
        split_tied = tied and plan.num_stages > 1
        self.export_drop = {"lm_head.weight"} if split_tied else set()
        first = last = None
        for s, stage in zip(plan.stage_ids, plan.modules):
            if split_tied and s == 0:
                first = stage.model.get_input_embeddings().weight
            if split_tied and s == plan.num_stages - 1:
                last = stage.model.lm_head.weight
                stage.norm_skip_names = {"model.lm_head.weight"}  # a copy of the embedding: count it once
        self.tied_sync = TiedEmbeddingSync(plan.modules, mesh, first, last) if split_tied else None
        param_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" and self.dims.dp_mode == "fsdp" else None
        fsdp = self.dims.dp_mode == "fsdp" and self.dims.dp > 1
        self.replica_sum = ReplicaGradSum(plan.modules, mesh) if fsdp and self.dims.tp > 1 else None
        self.run_modules = [apply_dp(stage, mesh, self.dims.dp_mode, param_dtype=param_dtype) for stage in plan.modules]
        ddp = self.dims.dp_mode == "ddp" and self.dims.dp > 1
        self.dp_sync = DataParallelGradSync(plan.modules, mesh) if ddp else None
        stages = make_pipeline_stages(self.run_modules, plan.stage_ids, plan.num_stages, mesh, self.device)
        self.schedule = build_schedule(cfg.schedule, stages, cfg.micro_batches, self._loss_fn())
        self.has_first, self.has_last = 0 in plan.stage_ids, plan.num_stages - 1 in plan.stage_ids
        if self.is_main:
            logger.info("model %s/%s: %.1fM parameters, mesh %s, schedule %s", cfg.family, cfg.preset, num_params / 1e6,
                        self.dims, cfg.schedule)

    def _loss_fn(self):
        """Mean next-token loss on the last stage: the model's own ``loss_function``, which
        `parallelize` makes vocab-parallel (the head returns this rank's vocabulary slice)."""
        last = [s for i, s in zip(self.plan.stage_ids, self.plan.modules) if i == self.plan.num_stages - 1]
        if not last:  # the schedule calls it on the last stage only, but needs one everywhere
            return _not_on_this_stage
        model, vocab = last[0].model, self.model_config.vocab_size
        return lambda logits, labels: model.loss_function(logits, labels, vocab, shift_labels=labels)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        decay, no_decay = [], []
        for stage in self.plan.modules:
            for p in stage.parameters():
                (decay if p.dim() >= 2 else no_decay).append(p)
        fused = {"fused": True} if self.device.type == "cuda" and self.dims.dp_mode != "fsdp" else {}
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **fused,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))

    # -- one step ---------------------------------------------------------------------------
    def _run_schedule(self, inputs, labels, *, train: bool) -> torch.Tensor:
        """Mean loss of this rank's batch on the last stage (0 elsewhere)."""
        args = (inputs.to(self.device),) if self.has_first else ()
        target = labels.to(self.device) if self.has_last else None
        losses: list = []
        with self.accelerator.autocast():
            if train:
                self.schedule.step(*args, target=target, losses=losses)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, target=target, losses=losses)
        if not self.has_last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([l.detach().double() for l in losses]).mean()  # stays on the device

    def _reduce(self, loss: torch.Tensor, *extra: float) -> list[float]:
        """Global mean loss and summed extras, on every rank, in one all-reduce and one host
        transfer (which also waits for the step's device work)."""
        counts = self.has_last and self.coords["tp"] == 0
        mine = loss / self.dims.dp if counts else torch.zeros_like(loss)
        values = torch.cat([mine.view(1), torch.tensor(extra, dtype=torch.float64).to(self.device)])
        dist.all_reduce(values)
        return values.tolist()

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; returns its metrics (on every rank)."""
        cfg = self.cfg
        start = time.perf_counter()
        inputs, labels = self.batches.batch(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._run_schedule(inputs, labels, train=True)
        if self.dp_sync is not None:
            self.dp_sync()
        if self.replica_sum:
            self.replica_sum()
        if self.tied_sync is not None:
            self.tied_sync()
        grad_norm = clip_grad_norm_(self.plan.modules, self.mesh, cfg.max_grad_norm, self.dims.dp_mode)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.batches.step = self.step
        sent, plain = _comm_totals()
        loss, sent, plain = self._reduce(loss, sent, plain)
        seconds = time.perf_counter() - start
        tokens = self.global_batch * cfg.seq_len
        return {
            "step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": seconds,
            "tokens_per_s": tokens / seconds,
            "tflops_per_device": self.flops_per_token * tokens / seconds / self.dims.world_size / 1e12,
            "comm_bytes_sent": sent, "comm_bytes_saved": plain - sent,
            "comm_compression": plain / sent if sent else 1.0,
        }

    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches (a collective)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in self.val:
            total += self._run_schedule(inputs, labels, train=False)
        _comm_totals()  # evaluation traffic is not part of the training step figures
        return self._reduce(total / len(self.val))[0]  # one collective and one host sync

    # -- the loop ---------------------------------------------------------------------------
    def train(self, until: int | None = None) -> list[dict]:
        """Train to ``cfg.steps`` (or stop after step ``until``, as a preempted job would: no
        export then); returns the metric history."""
        cfg, acc = self.cfg, self.accelerator
        until = cfg.steps if until is None else min(until, cfg.steps)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if cfg.trackers:
                acc.init_trackers(Path(cfg.output_dir).name or "pretrain", config=_flat(cfg.to_dict()))
        bar = _progress(cfg.steps, self.step, enabled=cfg.progress and self.is_main)
        while self.step < until:
            row = self.train_step()
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                row["val_loss"] = self.evaluate()
            self.history.append(row)
            if self.is_main:
                acc.log({k: v for k, v in row.items() if k != "step"}, step=self.step)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if self.step % cfg.log_every == 0 or "val_loss" in row:
                    logger.info(_format(row))
            if cfg.save_every and self.step % cfg.save_every == 0:
                self.save_checkpoint()
        bar.close()
        if self.step == cfg.steps:
            self._finish()
        return self.history

    def _finish(self) -> None:
        cfg = self.cfg
        if self.is_main:
            write_history(self.history, self.out / "history.jsonl")
            if cfg.plot and plot_losses(self.history, self.out / "loss.png",
                                       f"{cfg.family}/{cfg.preset} {self.dims}, TACO {'off' if cfg.compression is None else 'on'}"):
                logger.info("loss curve: %s", self.out / "loss.png")
        if cfg.export:
            from .export import export_pretrained

            export_pretrained(self.plan.modules, self.mesh, self.model_config, self.out / "final",
                              tokenizer=self.tokenizer, drop=self.export_drop)
        if self.is_main and cfg.trackers:
            self.accelerator.end_training()

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        meta = {"step": self.step, "dims": dataclasses.asdict(self.dims), "scheduler": self.scheduler.state_dict(),
                "data": self.batches.state_dict(), "history": self.history}
        return ckpt.save_checkpoint(self.out / "checkpoints" / f"step_{self.step}", stages=self.plan.modules,
                                    optimizer=self.optimizer, coords=self.coords, dp_mode=self.dims.dp_mode, meta=meta)

    def _resume(self, where: str) -> None:
        folder = ckpt.latest_checkpoint(self.out / "checkpoints") if where == "latest" else Path(where)
        if folder is None:
            logger.info("no checkpoint under %s: starting from scratch", self.out / "checkpoints")
            return
        meta = ckpt.load_checkpoint(folder, stages=self.plan.modules, optimizer=self.optimizer, coords=self.coords,
                                    dp_mode=self.dims.dp_mode, dims=dataclasses.asdict(self.dims))
        self.scheduler.load_state_dict(meta["scheduler"])
        self.batches.load_state_dict(meta["data"])
        self.step, self.history = meta["step"], meta["history"]


def _not_on_this_stage(logits, labels):
    raise AssertionError("the loss is computed on the last pipeline stage")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, str, bool)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _format(row: dict) -> str:
    text = (f"step {row['step']}: loss {row['loss']:.4f} lr {row['lr']:.2e} grad_norm {row['grad_norm']:.3f} "
            f"{row['tokens_per_s']:.0f} tok/s {row['tflops_per_device']:.3f} TFLOPS/device")
    if row["comm_bytes_sent"]:
        text += f" comm saved {row['comm_bytes_saved'] / 2**20:.2f} MiB ({row['comm_compression']:.2f}x)"
    if "val_loss" in row:
        text += f" val_loss {row['val_loss']:.4f}"
    return text


class _NoBar:
    def update(self, n=1): ...
    def set_postfix(self, **kw): ...
    def close(self): ...


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
