"""Convergence of the same training run under TACO and its ablations, with emulated TP.

Run ``python -m taco_accel.bench.convergence`` (CPU: the ``cpu-tiny`` preset, emulated tp=8).
Every variant trains the same model from the same initial weights on the same batches, in
one process, through the recipes' pretraining `Trainer` (`VariantRun`: the one training loop,
its AdamW, schedule, clipping and evaluation) on an `Accelerator` that emulates the tp ranks
(``parallelize(model, tp=tp, emulate=True)``): each row-parallel output,
the embedding's output and each column-parallel input gradient is summed over tp virtual
ranks through that variant's codec, exactly as a real tp group would (ARCHITECTURE.md has the
sites). Every message is compressed (mode "on", no size floor), as in a large model.

Variants (``--variants``, keys in brackets):

- uncompressed [none]: plain fp32 (bf16) sums;
- noise floor [reorder]: plain sums taken in the reverse rank order. It differs from
  ``none`` by fp32 rounding only, so its delta is a lower bound of the run-to-run noise (a
  compressed run, perturbed more, decorrelates from ``none`` sooner);
- naive per-tensor FP8 [naive]: one E4M3 scale per tensor (`naive_per_tensor_all_reduce`);
- per-group FP8 without Hadamard [no-hadamard]; Hadamard without the adaptive scale
  [no-adaptive]; per-group INT8, Hadamard [int8];
- TACO [taco] (the default `TacoConfig`), TACO with the paper's dual scales [taco-dual], TACO
  with E5M2 [e5m2];
- TACO at pipeline boundaries only [pp-boundaries]: TP sums plain, the hidden states and their
  gradients at the cuts of a pipeline of `BOUNDARY_STAGES` stages through the default codec
  (`taco_accel.parallel.emulate_boundaries`: what compressed pipeline boundaries send).

Each run writes ``<out>/seed<n>/<key>.json`` (its loss history) at every validation; a
finished record is reused unless ``--force``, so variants and seeds can run as separate
processes (one per GPU, or several on one) into one folder, and ``--report`` rebuilds the
table and ``<out>/convergence.png`` from what is there. ``--time-budget`` stops every run at
its first validation past the budget; runs that did not finish are compared at the last step
all runs of their seed validated. ``--prepare`` only tokenises into the cache, before several
runs start at once (``scripts/convergence_h200.sh``).

The table gives the final training loss (mean of the last 10% of steps), the final validation
loss (fixed validation batches) and their relative deltas against ``none``: the mean over
``--seeds``, with the range over seeds when there are several and, from three seeds, the
standard error of that mean. ``--fidelity`` adds what chaos cannot blur: every variant's loss
and gradient error at the same weights (those of the uncompressed run at 0, 25, ..., 100% of
the steps), `same_weights_fidelity`; ``--fidelity-only`` measures just that.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from taco_accel.bench.fidelity import naive_per_tensor
from taco_accel.codec import TacoConfig
from taco_accel.models import context_of
from taco_accel.parallel import emulate_boundaries
from taco_accel.training import TrainConfig, Trainer, model_config
from taco_accel.training.presets import pad_vocab
from taco_accel.training.trainer import device_type, pretraining_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    """One study size: model (a Qwen2 config), data and optimisation."""

    model: dict
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int
    tokenizer: str = "byte"
    tp: int = 8
    bf16: bool = False
    data: tuple[str, ...] = ()  # load_texts sources; () is the shipped stdlib corpus
    note: str = ""


_QWEN = dict(tie_word_embeddings=False)

PRESETS = {
    # the test suite's smoke run: seconds
    "nano": Preset(
        model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, **_QWEN),
        seq_len=32, batch=4, steps=4, lr=3e-3, warmup=1, eval_every=2, eval_batches=1, tp=8,
    ),
    # the laptop study: 0.9M parameters, 1024 tokens per step, minutes per variant on 2 cores
    "cpu-tiny": Preset(
        model=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, **_QWEN),
        seq_len=128, batch=8, steps=300, lr=3e-3, warmup=30, eval_every=50, eval_batches=8,
        note="kv heads replicated on 2 of the 8 ranks each",
    ),
    # the GPU study: 105M parameters (80M in the blocks), 8k tokens per step, bf16; pass more
    # text than the shipped corpus with --data (see benchmarks/results/convergence_cpu.md)
    "h200-100m": Preset(
        model=dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, **_QWEN),
        seq_len=1024, batch=8, steps=3000, lr=6e-4, warmup=200, eval_every=250, eval_batches=16,
        tokenizer="bpe:16384", bf16=True, note="kv heads replicated on 2 of the 8 ranks each",
    ),
}


# --- variants ---------------------------------------------------------------------------------


def naive_per_tensor_all_reduce(partials: Sequence[torch.Tensor], config: TacoConfig) -> tuple[torch.Tensor, int]:
    """A two-shot all-reduce with one FP8 scale per tensor, the baseline TACO improves on.

    Each rank quantises its whole partial with one scale (``max|x| / FP8_MAX``) and sends chunk
    r to rank r; rank r sums the dequantised chunks in fp32 and requantises its chunk with one
    scale; every rank decodes every chunk. ``config.format`` picks E4M3 or E5M2 (INT8: E4M3).
    An `EmulatedGroup` reducer (see `taco_accel.comm.emulated.Reducer`); bytes per rank: the
    fp8 payload plus one fp32 scale per chunk, both ways.
    """
    fmt = config.format if config.format in ("e4m3", "e5m2") else "e4m3"
    world, dtype = len(partials), partials[0].dtype
    total = torch.stack([naive_per_tensor(p, fmt).float() for p in partials]).sum(0)  # fp32 sums on the ranks
    chunks = total.view(-1).tensor_split(world)  # rank r's chunk
    out = torch.cat([naive_per_tensor(c, fmt) for c in chunks]).view(partials[0].shape).to(dtype)
    chunk_bytes = -(-total.numel() // world) + 4
    return out, 2 * (world - 1) * chunk_bytes


def reversed_plain_all_reduce(partials: Sequence[torch.Tensor], config: TacoConfig) -> tuple[torch.Tensor, int]:
    """The plain sum taken from the last rank to the first (the noise floor: fp32 rounding only)."""
    out = partials[-1].clone()
    for x in reversed(partials[:-1]):
        out += x
    return out, 2 * (len(partials) - 1) * out.numel() * out.element_size() // len(partials)


@dataclass(frozen=True)
class Variant:
    label: str
    fields: dict | None = None  # TacoConfig fields changed from the default; None: uncompressed
    reducer: object = None  # an EmulatedGroup reducer replacing the TACO all-reduce
    same_weights = True  # `same_weights_fidelity` measures it (its codec is the model's)

    def configure(self, cfg: TrainConfig) -> TrainConfig:
        """The variant's `TrainConfig` from the study's (`run_config`): the same by default."""
        return cfg

    def attach(self, run: "VariantRun") -> None:
        """Hook after the run is built (its model, parts and optimizer exist)."""

    def compression(self, group_size: int) -> TacoConfig | None:
        if self.fields is None:
            return None
        return TacoConfig(group_size=group_size, **self.fields)

    def prepare(self, model, preset: Preset, group_size: int) -> None:
        """What the variant changes in a built model beyond its TP codec (nothing here)."""

    def describe(self, group_size: int) -> str:
        if self.fields is None:
            return "fp32 / bf16 sums"
        if self.reducer is naive_per_tensor_all_reduce:
            return "E4M3, one scale per tensor"
        if self.reducer is reversed_plain_all_reduce:
            return "plain, reversed sum order"
        cfg = self.compression(group_size)
        return (
            f"{cfg.format.upper()} G={cfg.group_size}, {'Hadamard' if cfg.hadamard else 'no Hadamard'}, "
            f"{cfg.scales}{' no adaptive' if cfg.scales == 'dual' and not cfg.adaptive_scale else ''}"
        )


VARIANTS = {
    "none": Variant("uncompressed"),
    "reorder": Variant("noise floor: uncompressed, sums reversed", {}, reversed_plain_all_reduce),
    "naive": Variant("naive per-tensor FP8", {}, naive_per_tensor_all_reduce),
    "no-hadamard": Variant("per-group FP8, no Hadamard", {"hadamard": False}),
    "no-adaptive": Variant("Hadamard, no adaptive scale", {"scales": "dual", "adaptive_scale": False}),
    "int8": Variant("per-group INT8 (Hadamard)", {"format": "int8"}),
    "taco": Variant("TACO (default)", {}),
    "taco-dual": Variant("TACO, dual scales (paper)", {"scales": "dual"}),
    "e5m2": Variant("TACO, E5M2", {"format": "e5m2"}),
}
BASELINE = "none"


# --- data-parallel gradient compression: dp replicas emulated in the one process ----------------


@dataclass(frozen=True)
class ReplicaVariant(Variant):
    """TP plain; each step's batch split over ``replicas`` data-parallel replicas emulated in the
    process (micro-batch r of the step is replica r's local batch: the same global batch and
    mean loss as the other variants), whose gradients are reduced over an `EmulatedGroup` of
    ``replicas`` virtual ranks as `taco_accel.parallel.data_parallel` reduces them over a real
    dp group, through the same codec and pieces: ``grad`` (TacoConfig fields; None: plain fp32
    sums, this arrangement's noise floor) with ``feedback=True`` the compressed reduction of
    ``grad_compression`` (reduce-scatter summed in fp32, average, all-gather, error feedback at
    both ends: `feedback_average`), with ``feedback=False`` the TACO two-shot all-reduce of the
    TP sites (two roundings, nothing carried): the ablation."""

    grad: dict | None = None
    feedback: bool = True
    replicas: int = 2
    same_weights = False  # its codec is in the step, not the model

    def describe(self, group_size: int) -> str:
        if self.grad is None:
            return f"dp={self.replicas} plain fp32 sums"
        cfg = TacoConfig(group_size=group_size, **self.grad)
        how = "RS fp32 + AG, error feedback" if self.feedback else "two-shot, no feedback"
        return f"dp={self.replicas} grads {cfg.format.upper()} G={cfg.group_size}, {how}"

    def configure(self, cfg: TrainConfig) -> TrainConfig:
        if cfg.micro_batch_size % self.replicas:
            raise ValueError(f"{self.label}: the batch of {cfg.micro_batch_size} windows does not split over "
                             f"{self.replicas} replicas")
        return replace(cfg, micro_batch_size=cfg.micro_batch_size // self.replicas, micro_batches=self.replicas)

    def attach(self, run: "VariantRun") -> None:
        EmulatedReplicas(run, self)


class EmulatedReplicas:
    """Keeps each micro-batch's gradient apart (a post-accumulate hook on every parameter moves
    it into replica r's flat buffer and zeroes ``.grad``), then, as the step's gradient finisher
    (`ModelParts.finishers`, before clipping), writes the reduced mean of the replicas into
    ``.grad``. Sites ``dp.grad.bucket0/*`` record into the model's ledger (the recipes' dp bytes)."""

    def __init__(self, run: "VariantRun", variant: ReplicaVariant) -> None:
        from taco_accel.comm import EmulatedGroup, Site

        self.params = [p for p in run.parts.parameters() if p.requires_grad]
        self.replicas, self.feedback = variant.replicas, variant.feedback
        self.group = EmulatedGroup(variant.replicas)
        config = None if variant.grad is None else TacoConfig(group_size=run.group_size,
                                                              **variant.grad)
        ledger = context_of(run.model).sites.ledger
        self.rs, self.ag, self.ar = (Site(f"dp.grad.bucket0/{kind}", None, config, ledger=ledger)
                                     for kind in ("reduce_scatter", "all_gather", "all_reduce"))
        numel = sum(p.numel() for p in self.params)
        align = variant.replicas * (config.group_size if config is not None else 128)
        self.padded = -(-numel // align) * align
        self.flats = [torch.zeros(self.padded, device=self.params[0].device) for _ in range(variant.replicas)]
        self.workers = [torch.zeros_like(f) for f in self.flats]
        self.servers = [torch.zeros(self.padded // variant.replicas, device=f.device) for f in self.flats]
        self.offsets, offset = {}, 0
        for p in self.params:
            self.offsets[p] = offset
            offset += p.numel()
        self.calls = {p: 0 for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._keep)
        run.parts.finishers.append(self)

    def _keep(self, p) -> None:
        r = self.calls[p]
        if r >= self.replicas:
            raise RuntimeError(f"more than {self.replicas} backwards per step: one micro-batch per replica")
        self.calls[p] = r + 1
        self.flats[r][self.offsets[p]:self.offsets[p] + p.numel()].copy_(p.grad.reshape(-1))
        p.grad.zero_()

    def __call__(self) -> None:
        from taco_accel.parallel.data_parallel import feedback_average

        xs, world = [f.clone() for f in self.flats], self.replicas
        if self.rs.config is None or not self.feedback:
            mean = self.group.collective("all_reduce", xs, self.ar).div_(world)
        else:
            mean = feedback_average(
                xs, self.workers, self.servers,
                lambda xs, lost: list(self.group.collective("reduce_scatter", xs, self.rs, lost).view(world, -1)),
                lambda shards, lost: self.group.collective("all_gather", shards, self.ag, lost), divide=world)
        for p in self.params:
            p.grad.copy_(mean[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p.grad))
        for f in self.flats:
            f.zero_()
        self.calls = dict.fromkeys(self.calls, 0)


VARIANTS.update({
    "dp-plain": ReplicaVariant("noise floor: dp=2 replicas, plain sums"),
    "dp-taco": ReplicaVariant("dp gradients: TACO, error feedback", grad={}),
    "dp-taco-noef": ReplicaVariant("dp gradients: TACO two-shot, no feedback", grad={}, feedback=False),
})


# --- pipeline stage boundaries (issue 37): the codec where a pipeline cuts the model ---------------

BOUNDARY_STAGES = 4  # pp of the emulated pipeline (at most one stage per layer)


@dataclass(frozen=True)
class BoundaryVariant(Variant):
    """TP plain; the hidden states at the cuts of a pipeline of `BOUNDARY_STAGES` stages, and
    their gradients, through the codec (``fields`` over the default `TacoConfig`), as compressed
    pipeline boundaries send them: `emulate_boundaries`, the boundary sites' own round trip."""

    def compression(self, group_size: int) -> TacoConfig | None:
        return None  # the TP sums stay plain

    def stages(self, preset: Preset) -> int:
        return min(BOUNDARY_STAGES, preset.model["num_hidden_layers"])

    def prepare(self, model, preset: Preset, group_size: int) -> None:
        config = TacoConfig(group_size=group_size, **self.fields)
        emulate_boundaries(model, self.stages(preset), config, seq_len=preset.seq_len)

    def describe(self, group_size: int) -> str:
        cfg = TacoConfig(group_size=group_size, **self.fields)
        return f"{cfg.format.upper()} G={cfg.group_size} at the pipeline cuts (pp={BOUNDARY_STAGES}), TP plain"


VARIANTS["pp-boundaries"] = BoundaryVariant("TACO at pipeline boundaries only", {})


# --- one run ----------------------------------------------------------------------------------

MODEL_BASE = "tiny"  # the recipes' Qwen2 preset under every study model: `Preset.model` sets all its shape fields


@dataclass
class Data:
    """The tokenizer, token streams and model config of one study (shared by its variants)."""

    tokenizer: object
    train: torch.Tensor
    val: torch.Tensor
    config: object
    info: dict = field(default_factory=dict)


def load_data(preset: Preset, cache_dir: Path) -> Data:
    """Tokenise the preset's text (cached; `pretraining_tokens`, as the `Trainer` does) and build
    the Qwen2 config of its vocabulary (`model_config`, as the `Trainer` does)."""
    tok, train, val = pretraining_tokens(preset.data, preset.tokenizer, cache_dir)
    config = model_config("qwen2", MODEL_BASE, vocab_size=pad_vocab(len(tok)), max_positions=preset.seq_len,
                          **preset.model)
    info = {"train_tokens": train.numel(), "val_tokens": val.numel(), "vocab": config.vocab_size}
    return Data(tok, train, val, config, info)


def build_model(data: Data, variant: Variant, preset: Preset, seed: int, group_size: int, device: torch.device):
    """The seeded model, emulated over ``preset.tp`` ranks with the variant's codec (the initial
    weights of every run of ``seed``; `same_weights_fidelity` measures on it)."""
    from transformers import AutoModelForCausalLM

    import taco_accel

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(data.config)
    taco_accel.parallelize(model, tp=preset.tp, compression=variant.compression(group_size), emulate=True)
    if variant.reducer is not None:
        model.taco.emulator.reducer = variant.reducer
    variant.prepare(model, preset, group_size)
    return model.to(device)


def _loss(model, inputs, labels, device, bf16: bool) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inputs.to(device), use_cache=False).logits
    labels = labels.to(device)
    return model.loss_function(logits, labels, logits.shape[-1], shift_labels=labels)


def run_config(preset: Preset, *, seed: int, compression, device: torch.device) -> TrainConfig:
    """The `TrainConfig` of one study run: one process emulating tp=``preset.tp``, one
    micro-batch of ``preset.batch`` windows per step, AdamW (0.9 / 0.95, weight decay 0.1) at
    ``preset.lr`` with ``preset.warmup`` warm-up steps then cosine to 10%, clipping at 1, bf16
    autocast where the preset says; no files, trackers, export or progress bar."""
    return TrainConfig(
        family="qwen2", preset=MODEL_BASE, model_overrides=dict(preset.model), tp=preset.tp, compression=compression,
        tokenizer=preset.tokenizer, seq_len=preset.seq_len, micro_batch_size=preset.batch, micro_batches=1,
        steps=preset.steps, lr=preset.lr, min_lr_ratio=0.1, warmup_steps=preset.warmup, weight_decay=0.1,
        max_grad_norm=1.0, mixed_precision="bf16" if preset.bf16 else "no", seed=seed, eval_every=preset.eval_every,
        eval_batches=preset.eval_batches, log_every=preset.steps, output_dir=None, trackers=(), progress=False,
        export=False, plot=False, device="cpu" if device.type == "cpu" else None,
    )


class VariantRun(Trainer):
    """One variant of the study: the pretraining `Trainer` (the one loop, its optimizer, schedule,
    clipping and evaluation) on emulated TP with the variant's codec, the study's data shared
    with its other runs; it stops at a diverged loss or, past ``deadline``, at a validation."""

    run_name = "convergence"

    def __init__(self, key: str, data: Data, preset: Preset, *, seed: int, group_size: int, device: torch.device,
                 progress: bool = False, on_step: Callable | None = None, on_eval: Callable | None = None,
                 deadline: float | None = None):
        self.key, self.variant, self.preset, self.seed, self.group_size = key, VARIANTS[key], preset, seed, group_size
        self.data, self.verbose, self.on_step, self.on_eval, self.deadline = data, progress, on_step, on_eval, deadline
        self.start = time.perf_counter()
        cfg = run_config(preset, seed=seed, compression=self.variant.compression(group_size), device=device)
        super().__init__(self.variant.configure(cfg))
        if self.variant.reducer is not None:
            context_of(self.model).emulator.reducer = self.variant.reducer
        self.variant.prepare(self.model, preset, group_size)
        self.variant.attach(self)

    def load_tokens(self) -> tuple:
        return self.data.tokenizer, self.data.train, self.data.val

    def before_training(self) -> None:
        if self.on_step is not None:
            self.on_step(0, self.model)

    def train_step(self) -> dict:
        row = super().train_step()
        if self.on_step is not None:
            self.on_step(self.step, self.model)
        return row

    def format_row(self, row: dict) -> str:
        return f"{self.key} {super().format_row(row)}"

    def should_stop(self, row: dict) -> bool:
        if not math.isfinite(row["loss"]):
            logger.warning("%s diverged at step %d", self.key, row["step"])
            return True
        if "val_loss" not in row:
            return False
        if self.verbose:
            logger.info("%s step %d: loss %.4f val %.4f", self.key, row["step"], row["loss"], row["val_loss"])
        if self.on_eval is not None:
            self.on_eval(self.record())
        if self.deadline is not None and time.perf_counter() > self.deadline and self.step < self.preset.steps:
            logger.warning("%s: time budget spent, stopping at step %d of %d", self.key, self.step, self.preset.steps)
            return True
        return False

    def record(self) -> dict:
        return _record(self.key, self.variant, self.seed, self.group_size, self.history, self.start,
                       self.step == self.preset.steps and math.isfinite(self.history[-1]["loss"]))


def train_variant(key: str, data: Data, preset: Preset, *, seed: int, group_size: int, device: torch.device,
                  progress: bool = False, on_step: Callable | None = None, on_eval: Callable | None = None,
                  deadline: float | None = None) -> dict:
    """Train one variant (`VariantRun`); returns its record (loss history, finals, time, ``complete``).

    ``on_step(step, model)`` is called before the first step (0) and after every optimizer step;
    ``on_eval(record)`` after every validation with the record so far. Past ``deadline`` (a
    `time.perf_counter` value) the run stops at its next validation and is not ``complete``:
    runs that share a deadline are then compared at a step they all validated (`align`).
    """
    run = VariantRun(key, data, preset, seed=seed, group_size=group_size, device=device, progress=progress,
                     on_step=on_step, on_eval=on_eval, deadline=deadline)
    run.train()
    return run.record()


def _record(key: str, variant: Variant, seed: int, group_size: int, history: list[dict], start: float,
            complete: bool) -> dict:
    return {
        "key": key, "label": variant.label, "codec": variant.describe(group_size), "seed": seed,
        "steps": len(history), **_finals_of(history), "seconds": time.perf_counter() - start,
        "complete": complete, "history": list(history),
    }


def _finals_of(history: list[dict]) -> dict:
    """Final training loss (mean of the last 10% of steps) and the last validation loss."""
    tail = [h["loss"] for h in history[-max(1, len(history) // 10):]]
    return {"final_train": sum(tail) / len(tail), "final_val": history[-1].get("val_loss")}


def align(records: dict[str, dict]) -> tuple[dict[str, dict], int | None]:
    """One seed's records cut at the last step that all of them validated, when any stopped
    early (time budget); finals recomputed there. Returns the records and that step (None when
    all are complete and nothing was cut)."""
    if all(r.get("complete", True) for r in records.values()):
        return records, None
    validated = [{h["step"] for h in r["history"] if "val_loss" in h} for r in records.values()]
    common = set.intersection(*validated) if validated else set()
    if not common:
        return {}, 0
    step = max(common)
    cut = {}
    for key, record in records.items():
        history = [h for h in record["history"] if h["step"] <= step]
        cut[key] = {**record, **_finals_of(history), "steps": step, "history": history}
    return cut, step


# --- the codec's error at the same weights ----------------------------------------------------


class KeptWeights:
    """An ``on_step`` callback of `train_variant` that keeps a copy of the run's weights at 0, 25,
    50, 75 and 100% of ``steps`` (``states``, by step)."""

    def __init__(self, steps: int) -> None:
        self.wanted = sorted({round(f * steps) for f in (0.0, 0.25, 0.5, 0.75, 1.0)})
        self.states: dict[int, dict] = {}

    def __call__(self, step: int, model) -> None:
        if step in self.wanted:
            self.states[step] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    @property
    def complete(self) -> bool:
        return set(self.states) == set(self.wanted)


def same_weights_fidelity(data: Data, preset: Preset, keys: Sequence[str], *, seed: int, group_size: int,
                          device: torch.device, num_batches: int = 2, kept: KeptWeights | None = None) -> dict:
    """Loss and gradient of every variant at the weights of the uncompressed run, against the
    uncompressed ones: the codec's own error, free of the chaos of diverging trajectories.

    The weights of the uncompressed run of ``seed`` at 0, 25, 50, 75 and 100% of the steps:
    ``kept`` from that run if it kept them all, else from training it once more; at each, every
    variant runs forward and backward on the first ``num_batches`` validation batches. Returns
    ``{"steps": [...], key: {"loss_delta": [...], "grad_error": [...]}}`` with relative figures
    per kept step (``||g - g_ref|| / ||g_ref||`` over all parameters, before clipping).
    """
    from taco_accel.data import eval_batches

    if kept is None or not kept.complete:
        kept = KeptWeights(preset.steps)
        train_variant(BASELINE, data, preset, seed=seed, group_size=group_size, device=device, on_step=kept)
    val = eval_batches(data.val, preset.seq_len, preset.batch, preset.eval_batches)[:num_batches]
    models = {key: build_model(data, VARIANTS[key], preset, seed, group_size, device) for key in [BASELINE, *keys]}
    result = {"steps": kept.wanted, **{key: {"loss_delta": [], "grad_error": []} for key in keys}}
    for state in (kept.states[step] for step in kept.wanted):
        ref_loss, ref_grad = _loss_and_grad(models[BASELINE], state, val, device, preset.bf16)
        for key in keys:
            loss, grad = _loss_and_grad(models[key], state, val, device, preset.bf16)
            result[key]["loss_delta"].append((loss - ref_loss) / ref_loss)
            result[key]["grad_error"].append(float((grad - ref_grad).norm() / ref_grad.norm()))
    return result


def _loss_and_grad(model, state: dict, batches, device, bf16: bool) -> tuple[float, torch.Tensor]:
    """Mean loss over ``batches`` at the weights ``state``, and its gradient as one fp32 vector."""
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for inputs, labels in batches:
        loss = _loss(model, inputs, labels, device, bf16) / len(batches)
        loss.backward()
        total += loss.item()
    grad = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])
    return total, grad


def fidelity_table(result: dict) -> str:
    """Markdown table of `same_weights_fidelity`: mean and worst over the kept steps."""
    lines = [
        "| variant | loss delta at the same weights, mean (max abs) | gradient relative error, mean (max) |",
        "| --- | --- | --- |",
    ]
    for key in VARIANTS:
        if key not in result:
            continue
        deltas, errors = result[key]["loss_delta"], result[key]["grad_error"]
        lines.append(
            f"| {VARIANTS[key].label} | {100 * sum(deltas) / len(deltas):+.3f}% ({100 * max(map(abs, deltas)):.3f}%) "
            f"| {100 * sum(errors) / len(errors):.2f}% ({100 * max(errors):.2f}%) |"
        )
    return "\n".join(lines)


# --- report -----------------------------------------------------------------------------------


Records = dict[int, dict[str, dict]]  # seed -> variant key -> the record train_variant returns


def _delta(values: Sequence[float], bases: Sequence[float]) -> str:
    """Mean relative delta over seeds, in percent, with the range over seeds when several and
    the standard error of the mean (sample sd / sqrt(n)) from three seeds on."""
    deltas = [100 * (v - b) / b for v, b in zip(values, bases)]
    if not deltas or not all(math.isfinite(d) for d in deltas):
        return "-"
    n = len(deltas)
    mean = sum(deltas) / n
    text = f"{mean:+.2f}%"
    if n == 1:
        return text
    text += f" [{min(deltas):+.2f}, {max(deltas):+.2f}]"
    if n >= 3:
        sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (n - 1))
        text += f" s.e. {sd / math.sqrt(n):.2f}"
    return text


def _finals(records: Records, key: str, what: str) -> list[float]:
    return [r[key][what] if r[key][what] is not None else math.nan for r in records.values()]


def table(records: Records) -> str:
    """Markdown table: finals (mean over seeds) and their deltas against the uncompressed run."""
    seeds = list(records)
    keys = [k for k in VARIANTS if all(k in records[s] for s in seeds)]
    lines = [
        "| variant | codec | final train loss | delta | final val loss | delta |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    has_base = BASELINE in keys
    for key in keys:
        first = records[seeds[0]][key]
        row = [first["label"], first["codec"]]
        for what in ("final_train", "final_val"):
            values = _finals(records, key, what)
            delta = _delta(values, _finals(records, BASELINE, what)) if has_base else "-"
            row += [f"{sum(values) / len(values):.4f}", delta]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _mean_curve(histories: list[list[dict]], field_name: str) -> tuple[list[int], list[float]]:
    """Steps and the mean over seeds of ``field_name`` at the steps every run recorded it."""
    per_run = [{h["step"]: h[field_name] for h in hist if field_name in h} for hist in histories]
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    return steps, [sum(r[s] for r in per_run) / len(per_run) for s in steps]


def plot(records: Records, path: Path, title: str) -> bool:
    """Training (smoothed) and validation loss curves of every variant, mean over seeds;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    seeds = list(records)
    fig, (ax_train, ax_val, ax_delta) = plt.subplots(1, 3, figsize=(17, 4.8), dpi=110)
    window = 1
    keys = [k for k in VARIANTS if all(k in records[s] for s in seeds)]
    base = _mean_curve([records[s][BASELINE]["history"] for s in seeds], "val_loss") if BASELINE in keys else None
    for key in keys:
        histories = [records[s][key]["history"] for s in seeds]
        label = records[seeds[0]][key]["label"]
        steps, losses = _mean_curve(histories, "loss")
        window = max(1, len(steps) // 30)
        smooth = torch.tensor(losses).unfold(0, window, 1).mean(1).tolist() if len(losses) >= window else losses
        ax_train.plot(steps[len(steps) - len(smooth):], smooth, label=label, lw=1.1)
        val_steps, val = _mean_curve(histories, "val_loss")
        ax_val.plot(val_steps, val, "o-", label=label, lw=1.1, ms=3)
        if base is not None:
            ref = dict(zip(*base))
            pairs = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in zip(val_steps, val) if s in ref]
            ax_delta.plot(*zip(*pairs), "o-", label=label, lw=1.1, ms=3)
    mean = f" (mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""
    ax_train.set_title(f"training loss (running mean of {window} steps){mean}", fontsize=9)
    ax_val.set_title(f"validation loss{mean}", fontsize=9)
    ax_delta.set_title(f"validation loss vs uncompressed, %{mean}", fontsize=9)
    for ax in (ax_train, ax_val, ax_delta):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_train.set_ylabel("loss (nats / token)")
    ax_delta.axhline(0.0, color="black", lw=0.8)
    if base is not None:  # without the baseline the delta panel has no curves to name
        ax_delta.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def load_records(out: Path, seeds: Sequence[int], variants: Sequence[str] = tuple(VARIANTS)) -> Records:
    """What ``out/seed<n>/<key>.json`` holds for each seed and variant; where a run stopped
    early, each seed's records cut at a step all of them validated (`align`, logged)."""
    found = {}
    for seed in seeds:
        folder = out / f"seed{seed}"
        paths = {k: folder / f"{k}.json" for k in variants}
        records = {k: json.loads(path.read_text()) for k, path in paths.items() if path.exists()}
        found[seed], step = align(records)
        if step is not None:
            logger.warning("seed %d: not every run finished; compared at step %d, the last all of them validated",
                           seed, step)
    return found


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--tp", type=int, help="emulated tp degree (default: the preset's, 8)")
    parser.add_argument("--steps", type=int, help="override the preset's step count")
    parser.add_argument("--eval-every", type=int, help="override the preset's validation interval")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed (weights and batch order)")
    parser.add_argument("--data", nargs="+", help="text sources for load_texts (files, globs); default: the preset's")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when available, unless Accelerate is told to use the CPU")
    parser.add_argument("--out", default="runs/convergence", help="folder of the per-variant JSON files and the PNG")
    parser.add_argument("--force", action="store_true", help="rerun variants whose JSON already exists")
    parser.add_argument("--report", action="store_true", help="only rebuild the table and PNG from --out")
    parser.add_argument("--prepare", action="store_true",
                        help="only tokenise the data into --out's cache (before starting runs in parallel)")
    parser.add_argument("--time-budget", type=float, metavar="MINUTES",
                        help="stop each run at its first validation after this many minutes from the start "
                             "(runs are then compared at a step all of them validated)")
    parser.add_argument("--fidelity", action="store_true",
                        help="also measure every variant's loss and gradient error at the uncompressed run's weights "
                             "(first seed; the uncompressed run trains once more unless it runs here to the end)")
    parser.add_argument("--fidelity-only", action="store_true", help="--fidelity without the runs of the variants")
    return parser.parse_args(argv)


def resolve_preset(args: argparse.Namespace) -> Preset:
    preset = PRESETS[args.preset]
    changes = {k: v for k, v in (("tp", args.tp), ("steps", args.steps)) if v is not None}
    if args.data:
        changes["data"] = tuple(args.data)
    if changes.get("steps") is not None:
        changes["eval_every"] = min(preset.eval_every, changes["steps"])
        changes["warmup"] = min(preset.warmup, max(1, changes["steps"] // 10))
    if args.eval_every is not None:
        changes["eval_every"] = args.eval_every
    return replace(preset, **changes)


def run_seed(args: argparse.Namespace, preset: Preset, data: Data, seed: int, params: int, device,
             deadline: float | None = None, kept: KeptWeights | None = None) -> None:
    """Train every requested variant of one seed into ``out/seed<n>/`` (complete records kept);
    ``kept``: the ``on_step`` of the uncompressed run, if it runs.

    The record is written at every validation, so a run that is killed leaves what it did."""
    folder = Path(args.out) / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for key in args.variants:
        path = folder / f"{key}.json"
        if path.exists() and json.loads(path.read_text()).get("complete", True) and not args.force:
            logger.info("%s seed %d: reusing %s", key, seed, path)
            continue

        def save(record: dict, path: Path = path) -> None:
            record.update(preset=args.preset, tp=preset.tp, params=params, data=data.info,
                          preset_fields=asdict(preset))
            path.write_text(json.dumps(record))

        record = train_variant(key, data, preset, seed=seed, group_size=args.group_size, device=device,
                               progress=True, on_eval=save, deadline=deadline,
                               on_step=kept if key == BASELINE else None)
        save(record)
        logger.info("%s seed %d: train %.4f val %.4f in %.0f s (%d steps%s)", key, seed, record["final_train"],
                    record["final_val"], record["seconds"], record["steps"],
                    "" if record["complete"] else ", stopped by the time budget")


def run_study(args: argparse.Namespace, preset: Preset, out: Path, device: torch.device,
              deadline: float | None) -> None:
    """Train the requested seeds and variants into ``out``, then (``--fidelity``) measure at the
    uncompressed run's weights."""
    data = load_data(preset, out / "cache")
    model = build_model(data, VARIANTS[BASELINE], preset, args.seeds[0], args.group_size, torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())
    del model
    logger.info("%s: %.2fM parameters, %s, emulated tp=%d", args.preset, params / 1e6, data.info, preset.tp)
    fidelity = args.fidelity or args.fidelity_only
    kept = KeptWeights(preset.steps) if fidelity else None  # the first seed's uncompressed run, if it runs here
    for seed in [] if args.fidelity_only else args.seeds:
        run_seed(args, preset, data, seed, params, device, deadline, kept if seed == args.seeds[0] else None)
    if fidelity:
        keys = [k for k in args.variants if k != BASELINE and VARIANTS[k].same_weights]
        result = same_weights_fidelity(data, preset, keys, seed=args.seeds[0], group_size=args.group_size,
                                       device=device, kept=kept)
        folder = out / f"seed{args.seeds[0]}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fidelity.json").write_text(json.dumps(result))


def main(argv: Sequence[str] | None = None) -> Records:
    """Run (or with ``--report`` only report) the study; prints the table, writes the PNG."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    start = time.perf_counter()
    preset, out, device = resolve_preset(args), Path(args.out), torch.device(device_type(args.device))
    out.mkdir(parents=True, exist_ok=True)
    if args.prepare:
        data = load_data(preset, out / "cache")
        logger.info("%s: data cached in %s: %s", args.preset, out / "cache", data.info)
        return {}
    if not args.report:
        started = not dist.is_initialized()  # the runs' Accelerator starts a one-process group
        try:
            run_study(args, preset, out, device, deadline=None if args.time_budget is None
                      else start + 60 * args.time_budget)
        finally:
            if started and dist.is_initialized():
                dist.destroy_process_group()
    records = load_records(out, args.seeds, args.variants)
    print(f"{args.preset}, emulated tp={preset.tp}, {preset.steps} steps, seeds {', '.join(map(str, args.seeds))} "
          f"(deltas: mean over seeds, range in brackets)\n")
    print(table(records))
    fidelity = out / f"seed{args.seeds[0]}" / "fidelity.json"
    if fidelity.exists():
        result = json.loads(fidelity.read_text())
        print(f"\nat the uncompressed run's weights (seed {args.seeds[0]}, steps {result['steps']}):\n")
        print(fidelity_table(result))
    command = shlex.join(["python", "-m", "taco_accel.bench.convergence", *(sys.argv[1:] if argv is None else argv)])
    title = f"{args.preset}, emulated tp={preset.tp}: {command}"
    if any(records.values()) and plot(records, out / "convergence.png", title):
        logger.info("loss curves: %s", out / "convergence.png")
    return records


if __name__ == "__main__":
    main()
