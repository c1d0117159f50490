"""A model laid out on the ``("pp", "dp", "tp")`` mesh: this rank's parts, and what ends a backward.

`distribute` runs the passes in their one order, torchtitan style, and returns `ModelParts`:

1. tensor parallelism over ``mesh["tp"]`` on the whole model (`apply_tp`; a model that the
   user already parallelised is checked against the mesh instead);
2. pipeline stages (`apply_pp`), only when asked: the modules this rank runs are then
   `StageModule`s, otherwise the transformers model itself;
3. the device, then data parallelism over ``mesh["dp"]`` (`apply_dp`: FSDP2 shards in place;
   DDP replicas average their gradients in `finish_gradients`).

`ModelParts.finish_gradients` is what every training step runs after its last backward and
before clipping, exactly once per optimizer step: the tp sums of replicated parameters FSDP2
hides from `parallelize`'s hooks, the dp average of DDP replicas (FSDP2 reduce-scatters during
the last backward), and the tied embedding's sum across pipeline stages. ``grad_compression``
compresses the dp reduction (`data_parallel`: error feedback, residuals in checkpoints through
`ModelParts.feedback_state`). Which backwards it must finish is learnt from the parameters
themselves (`ModelParts.watch_gradients`), whatever tensor the loss was computed from.
`clip_grad_norm_` clips by the norm of the whole unsharded model's gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.agreement import check_setting
from ..comm.policy import DEFAULT_COMPRESSION, Compression, check_same
from ..models.loss import causal_lm_of, install_head, is_causal_lm
from .compile import apply_compile
from .data_parallel import (
    DataParallelGradSync,
    FsdpGradCompression,
    ReplicaGradSum,
    TiedEmbeddingSync,
    apply_dp,
    grad_sites,
    local_tensor,
)
from .mesh import ParallelDims
from .pipeline import apply_pp, is_tied
from .stage import site_tables, taco_context
from .tensor_parallel import apply_tp, check_parallelized

logger = logging.getLogger(__name__)


@dataclass
class ModelParts:
    """This rank's parts of one model on the mesh (torchtitan's ``model_parts``).

    ``modules``: what this rank runs, in stage order (``[model]`` without pipeline stages).
    ``stage_ids`` / ``num_stages``: their pipeline stage numbers and the total (``[0]`` / 1).
    ``norm_shares``: per parameter (by id), the share of its squared gradient norm this rank
    counts, so that the sum over the mesh is the unsharded model's (1/replicas over tp, 1/dp
    for DDP replicas, 0 for a tied head's copy). ``export_drop``: keys a full export leaves
    out (the head copy of a tied model split across stages).
    """

    modules: list[nn.Module]
    mesh: DeviceMesh
    dims: ParallelDims
    stage_ids: list[int] = field(default_factory=lambda: [0])
    num_stages: int = 1
    norm_shares: dict[int, float] = field(default_factory=dict)
    export_drop: set[str] = field(default_factory=set)
    finishers: list = field(default_factory=list)
    grad_sites: object = None  # a tp.sites.SiteTable over the dp group
    grad_reduce: object = None  # DataParallelGradSync or FsdpGradCompression, when compressed
    _dirty: bool = False  # a backward accumulated into a trainable parameter since the last finish
    _reduced: bool = False  # finished, and the optimizer has not stepped (or zeroed) since
    _handles: list = field(default_factory=list, repr=False)

    def site_tables(self) -> list:
        """The site tables of this model's communication (TP, pipeline boundaries, compressed
        gradients): where its settings, auto decisions and statistics ledgers are."""
        tables = [table for module in self.modules for table in site_tables(module)]
        return tables if self.grad_sites is None else [*tables, self.grad_sites]

    def ledgers(self) -> list:
        """The statistics ledgers of this model's sites, each once: where this model's
        communication figures are read."""
        out = []
        for table in self.site_tables():
            if all(table.ledger is not seen for seen in out):
                out.append(table.ledger)
        return out

    def named_parameters(self):
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def watch_gradients(self) -> None:
        """Mark the gradients dirty whenever a backward accumulates into any parameter that is
        trainable now (``register_post_accumulate_grad_hook``; FSDP2 calls these hooks after its
        reduce-scatter).

        Why the parameters and not the outputs: a loss may come from any output tensor (the
        logits, hidden states, a custom head), from several backwards per step, through
        ``loss.backward()`` as well as ``accelerator.backward``; every one of them ends in the
        parameters' ``.grad``. The reduction itself stays lazy, once per optimizer step
        (`finish_gradients`, at the first of clipping or the step), so gradient accumulation
        needs no communication and nothing runs inside the compiled forward or backward (the
        hook only sets a flag). A parameter made trainable after this call is not watched.
        """
        for p in self.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._mark))

    def _mark(self, _param) -> None:
        if self._reduced and self.finishers:
            raise RuntimeError(
                "a backward ran after this step's gradients were reduced over the data-parallel replicas "
                "(clip_grad_norm_) and before optimizer.step(): the new gradients would never be averaged. Call "
                "accelerator.clip_grad_norm_ after the last backward of the step, then optimizer.step()"
            )
        self._dirty = True

    def finish_gradients(self) -> bool:
        """Reduce the gradients of the backwards since the last call (a collective on every rank
        that ran them); False when there was none to finish."""
        if not self._dirty:
            return False
        for finish in self.finishers:
            finish()
        self._dirty, self._reduced = False, True
        return True

    def step_done(self) -> None:
        """The optimizer stepped or zeroed the gradients: the next backward starts a new step."""
        self._reduced = False

    def grad_norm_sq(self, params: list[nn.Parameter] | None = None) -> torch.Tensor:
        """This rank's share of the squared gradient norm (float64, on the gradients' device)."""
        chosen = {id(p) for p in params} if params is not None else None
        grads, shares = [], []
        for p in self.parameters():
            share = self.norm_shares.get(id(p), 0.0)
            if p.grad is None or share == 0.0 or (chosen is not None and id(p) not in chosen):
                continue
            grads.append(local_tensor(p.grad).detach())
            shares.append(share)
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)  # one launch, no host sync
        squares = torch._foreach_mul(norms, norms)
        torch._foreach_mul_(squares, shares)  # the shares as kernel arguments: no host-to-device copy
        return torch.stack(squares).sum()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def feedback_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals of the compressed dp reduction, by name (empty
        when it is off or has not run): what a checkpoint keeps per mesh coordinate."""
        return {} if self.grad_reduce is None else self.grad_reduce.feedback_state()

    def load_feedback_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Take the residuals `feedback_state` gave on the same mesh (a checkpoint's)."""
        if self.grad_reduce is not None:
            self.grad_reduce.load_feedback_state(saved)


def clip_grad_norm_(parts: list[ModelParts], params: list[nn.Parameter], max_norm: float,
                    finish: bool = True, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Finish the gradients of ``parts`` (`ModelParts.finish_gradients`; ``finish=False``: clip
    them as they are, e.g. inside gradient accumulation), then clip ``params``
    (theirs, or a subset) by the norm of the whole unsharded model's gradient over the mesh,
    every tp shard, pipeline stage and FSDP shard counted once. A collective over all ranks;
    returns the norm before clipping, a float64 0-d tensor on the gradients' device, without a
    host sync (the factor is 1 where the norm is within ``max_norm``). ``max_norm``: a number
    >= 0 (``0`` only measures, ``inf`` never clips); NaN or a negative value raises a
    ValueError (torch's own clip would turn every gradient into NaN or flip its sign).
    ``extra``: a small float tensor summed over the mesh in place, in the norm's all-reduce (a
    step's flags: `comm.stats.WireCheck`)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) and not (
            torch.is_tensor(max_norm) and max_norm.numel() == 1):
        raise TypeError(f"max_norm={max_norm!r}: pass a number (the largest gradient norm, e.g. 1.0)")
    if not float(max_norm) >= 0:
        raise ValueError(f"max_norm={max_norm!r}: pass a number >= 0 (e.g. 1.0; 0 measures without clipping, "
                         "inf never clips)")
    max_norm = float(max_norm)
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in parts:
        if finish:
            part.finish_gradients()
        total += part.grad_norm_sq(params).to(device)
    if extra is None:
        dist.all_reduce(total)  # the default group spans the mesh
    else:
        both = torch.cat([total.view(1), extra.to(total).view(-1)])
        dist.all_reduce(both)
        total = both[0]
        extra.copy_(both[1:].view_as(extra))
    norm = total.sqrt()
    if max_norm > 0:
        factor = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor.to(torch.float32))  # as a Python float would: fp32 math
    return norm


def distribute(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    compression=DEFAULT_COMPRESSION,
    grad_compression="off",
    sequence_parallel: bool = False,
    logits: str | None = None,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
    pipeline: bool = False,
    stages_per_rank: int = 1,
    seq_len: int = 2048,
    evaluation: bool = False,
    compile: str | None = None,
    compile_options: dict | None = None,
) -> ModelParts:
    """Lay ``model`` out on ``mesh`` (a collective on every rank); return this rank's parts.

    ``compression`` / ``sequence_parallel`` / ``logits`` go to `parallelize` when the model is
    not yet tensor parallel (``compression``: anything `Compression.resolve` takes, ``"auto"`` by
    default; ``logits=None``: ``"full"``); a
    ``logits`` mode given for a parallel model replaces its own. A supported causal LM computes
    its head and loss through `models.loss` at every tp, tp=1 included (`models.loss.install_head`,
    which also takes over TRL's fused LM head). ``grad_compression`` (anything
    `Compression.resolve` takes, ``"off"`` by default): the compressed dp gradient reduction
    with error feedback (`data_parallel`); every rank must pass the same (a `CollectiveMismatch`
    on every rank otherwise). ``pipeline``: split into
    ``pp * stages_per_rank`` `StageModule`s (``seq_len`` balances them); without it pp must be 1.
    ``param_dtype``: FSDP2's compute dtype (e.g. bf16 under mixed precision).
    ``evaluation``: tensor parallel (and placed) only, as Accelerate's ``evaluation_mode``: no
    FSDP2 sharding, no gradient reductions, nothing watched.
    ``compile``: a torch.compile backend (``"inductor"``, ...) applied last, in place, to each
    module of the parts (`compile.apply_compile`, with ``compile_options``: mode, fullgraph,
    dynamic); None leaves them eager. Enable activation checkpointing before (on the model).
    """
    compression = Compression.resolve(compression)
    grad_compression = Compression.resolve(grad_compression)
    if not pipeline and dims.pp > 1:
        raise ValueError(
            f"the mesh has pp={dims.pp} but this model is prepared without pipeline stages; use "
            "accelerator.prepare_pipeline(model, ...) (or the Trainer), or size the mesh so that dp x tp "
            "covers every process (e.g. parallelism_config dp_replicate_size / dp_shard_size)"
        )
    if getattr(model, "taco", None) is not None:
        check_same(compression, model.taco.compression, "distribute")
        check_parallelized(model, mesh)
        replicas = _replicas_of(model, dims.tp)
    else:
        replicas = apply_tp(model, mesh, compression, sequence_parallel, logits or "full")
    if is_causal_lm(causal_lm_of(model)):  # the head and loss at every tp (tp=1: the model's own head)
        install_head(model, logits)
    tied = is_tied(model) if pipeline else False
    if pipeline:
        plan = apply_pp(model, mesh, stages_per_rank, seq_len=seq_len,
                        sequence_parallel=sequence_parallel and dims.tp > 1, compression=compression)
        modules, stage_ids, num_stages = plan.modules, plan.stage_ids, plan.num_stages
        prefix = "model."
    else:
        modules, stage_ids, num_stages, prefix = [model], [0], 1, ""
    parts = ModelParts(modules, mesh, dims, stage_ids, num_stages)
    if device is not None:
        for module in modules:
            module.to(device)
    split_tied = tied and num_stages > 1
    skip, tied_sync = _split_tied(parts) if split_tied else (set(), None)
    if not evaluation:
        _apply_dp(parts, mesh, dims, param_dtype, grad_compression)
        if tied_sync is not None:
            parts.finishers.append(tied_sync)
    dp_share = 1.0 / dims.dp if dims.dp_mode == "ddp" or evaluation else 1.0  # replicas hold it all
    for name, p in parts.named_parameters():
        key = name[len(prefix):] if name.startswith(prefix) else name
        parts.norm_shares[id(p)] = 0.0 if name in skip else dp_share / replicas.get(key, dims.tp)
    if not evaluation:
        parts.watch_gradients()
    if compile is not None:
        apply_compile(parts.modules, compile, **(compile_options or {}))
    return parts


def _apply_dp(parts: ModelParts, mesh: DeviceMesh, dims: ParallelDims, param_dtype,
              grad_compression: Compression) -> None:
    """Data parallelism over ``mesh["dp"]`` for every module of ``parts``, and the reductions
    that finish its gradients (compressed as ``grad_compression`` says)."""
    if dims.dp > 1:  # every rank of the world: the same setting, or an error on every rank now
        check_setting("grad_compression", grad_compression.to_dict(),
                      fix="pass the same grad_compression (--grad-compression) to every process")
    context, _ = taco_context(parts.modules[0])
    sites = grad_sites(mesh, grad_compression, context.sites.ledger if context is not None else None)
    if dims.dp_mode == "fsdp" and dims.dp > 1 and dims.tp > 1:
        replica_sum = ReplicaGradSum(parts.modules, mesh)  # before FSDP2 replaces the parameter objects
        if replica_sum:
            parts.finishers.append(replica_sum)
    parts.modules = [apply_dp(m, mesh, dims.dp_mode, param_dtype=param_dtype) for m in parts.modules]
    parts.grad_sites = sites
    if dims.dp_mode == "ddp" and dims.dp > 1:
        sync = DataParallelGradSync(parts.modules, mesh, sites=sites)
        parts.finishers.append(sync)
        parts.grad_reduce = sync if sites is not None else None
    elif sites is not None:
        parts.grad_reduce = FsdpGradCompression(parts.modules, parts.stage_ids, sites)
    if sites is not None:
        logger.info("data-parallel gradient reduction: %s, error feedback, over %d replicas", grad_compression, dims.dp)


def _replicas_of(model: nn.Module, tp: int) -> dict[str, int]:
    """How many tp ranks hold each parameter's values (an emulated model holds them whole)."""
    if model.taco.emulated:
        return {n: 1 for n, _ in model.named_parameters()}
    from ..models.state import tp_replicas

    return tp_replicas(model, tp)


def _split_tied(parts: ModelParts) -> tuple[set[str], TiedEmbeddingSync]:
    """A tied embedding and head on different stages: the last stage's head is a copy kept
    equal by a gradient sum (`TiedEmbeddingSync`); its norm counts once, its export not at all."""
    first = last = None
    skip = set()
    for s, stage in zip(parts.stage_ids, parts.modules):
        if s == 0:
            first = stage.model.get_input_embeddings().weight
        if s == parts.num_stages - 1:
            last = stage.model.lm_head.weight
            skip.add("model.lm_head.weight")
    parts.export_drop = {"lm_head.weight"}
    return skip, TiedEmbeddingSync(parts.modules, parts.mesh, first, last)
