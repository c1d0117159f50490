"""`parallelize`: rewrite a transformers causal LM in place into a tensor-parallel one."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from ..codec import TacoConfig
from ..codec.config import GROUP_SIZES
from ..comm.dist_ops import group_rank, group_size
from ..tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..tp.overlap import ColumnRegion
from ..tp.regions import EnterRegionHook, RegionEntry, RegionExit, SequenceGather, SequenceSplit, SequenceState
from ..comm.policy import DEFAULT_COMPRESSION, Compression
from ..tp.sites import Site, SiteTable
from ..upstream import transformers as upstream_transformers
from .checks import check_call, install_input_checks, verify_same_model
from .context import TPContext, context_of
from .emulate import emulate_tp
from .loss import LogitsMode, check_logits_mode, install_head
from .plan import Colwise, EnterRegion, Rowwise, TPPlan
from .rewrite import Rewrite, check_tp
from .state import bind_save_pretrained

logger = logging.getLogger(__name__)


def parallelize(
    model: nn.Module,
    tp: int | None = None,
    compression: Compression | str | os.PathLike | TacoConfig | dict | None = DEFAULT_COMPRESSION,
    sequence_parallel: bool = False,
    device_mesh=None,
    emulate: bool = False,
    verify: bool = True,
    logits: LogitsMode = "full",
) -> nn.Module:
    """Make a transformers causal LM tensor parallel over ``tp`` ranks, in place; returns it.

    Args:
        model: a Qwen2/Qwen2.5, Qwen3, Llama, Mistral or GPT-2 causal LM with the same
            weights on every rank (e.g. built with the same seed, or loaded on every rank; see
            `taco_accel.from_pretrained` to load only the local slices). Parallelise first,
            then move it to its device: only 1/tp of the weights remain.
        tp: tensor-parallel degree. Default: the size of ``device_mesh``'s tp group, else the
            world size. A tp smaller than the world size without a mesh makes groups of
            consecutive ranks.
        compression: whether and how the TP collectives are compressed: anything
            `Compression.resolve` takes. ``"auto"`` (default): every site is timed plain
            against compressed at its real message size on this group during its first call
            (the first training step) and compressed only where that is faster, the same
            decision on every rank (`taco_accel.comm.autotune`); the decisions are logged and
            ``model.taco.sites.decisions()`` returns them as a dict. ``"on"`` or a `TacoConfig`:
            every message compressed; ``"off"`` or ``None``: plain TP. A `Compression`, its dict
            or the path of its JSON file set the mode, the settings per direction and per site.
        sequence_parallel: split the residual stream along the sequence between blocks
            (norms and dropout on 1/tp of the tokens); training sequences must divide by tp.
        device_mesh: a 1-D DeviceMesh, a DeviceMesh with a ``"tp"`` dimension, or a
            ProcessGroup: the ranks that share this model's weights.
        emulate: run ``tp`` virtual ranks in this one process, no torch.distributed needed
            (a laptop, one GPU): every collective of real TP goes through the same codec
            calls on the same per-rank tensors, so losses and gradients match a real
            compressed run (see `taco_accel.tp.emulate`). The parameters stay whole, so the
            model saves and loads as the transformers model it was. Needs ``tp``.
        verify: check that every TP rank holds the same model (`checks.verify_same_model`:
            config, parameter names, shapes, dtypes and a checksum of 4096 sampled values
            each, one all-gather over the group; it grows with the number of parameter
            tensors, not their size: measured on CPU for a 110M-parameter Qwen2, 146 tensors,
            8 ms to compute and 30 ms with the exchange on 2 gloo ranks), and that the first
            forward gives every TP rank the same ``input_ids`` (one all-gather of 5 numbers).
            False skips both (huge models, or a start-up that must not wait).
        logits: what ``outputs.logits`` holds (`taco_accel.models.loss`, whose forward replaces
            the model's; ``model.taco.logits`` changes it later). ``"full"`` (default): the full
            vocabulary, as transformers returns it, with or without ``labels``, differentiable (a
            loss computed from the logits trains right); transformers' default loss is
            vocab-parallel either way, a ``loss_function`` of your own gets the full logits.
            ``"local"``: with ``labels``, this rank's vocabulary slice (b, s, V/tp), saving the
            all-gather and the full tensor when only ``outputs.loss`` is used; ``"none"``: with
            ``labels``, no logits (None): the head's matmul and the loss run fused, in chunks of
            tokens; without labels the full logits in every mode.

    Refused with a ValueError: peft, quantized, DDP/FSDP-wrapped or DTensor-sharded models,
    ``nn.Linear`` / ``nn.Embedding`` subclasses where the plan swaps modules, argument values
    outside their range. Every forward raises an IndexError for token ids (and the loss for
    labels other than -100) outside the vocabulary, as plain transformers does.
    """
    if getattr(model, "taco", None) is not None:
        raise ValueError(
            f"this model is already parallelised (tp={model.taco.tp}); call parallelize on a "
            "fresh transformers model, or use it as it is"
        )
    upstream_transformers.check_model(model)
    compression = Compression.resolve(compression)
    plan = check_call(model, tp, sequence_parallel, device_mesh, emulate, verify)  # before any collective
    check_logits_mode(logits)
    if emulate:
        return emulate_tp(model, plan, tp, compression, sequence_parallel, device_mesh, logits)
    if tp is not None:
        check_tp(model, plan, tp)  # before any collective: wrong numbers fail fast
    group, tp = _resolve_group(tp, device_mesh)
    if verify:
        verify_same_model(model, group)  # a collective: every rank raises on a difference
    check_tp(model, plan, tp)
    context = TPContext(
        plan, group, tp, group_rank(group), compression, SiteTable(group, compression),
        SequenceState(bool(sequence_parallel), tp),
    )
    _apply_plan(model, plan, context, logits)
    install_input_checks(model, plan, group, same_batch=verify)
    _sync_rng(group)
    model.taco = context
    bind_save_pretrained(model)
    logger.info(
        "tensor parallel %s: tp=%d, sequence_parallel=%s, %s",
        plan.name, tp, context.sequence_parallel, context.sites.summary(),
    )
    return model


def _sync_rng(group) -> None:
    """Give the TP ranks the random state of the group's first rank.

    The ranks run the same operations in the same order, so from here on they draw the same
    random numbers: dropout on the replicated residual stream keeps the replicas identical
    (different masks would make "replicated" activations and the gradients of replicated
    weights differ between ranks). Dropout inside a sharded region draws the same mask
    pattern on every shard, as without a separate per-rank generator (Megatron keeps one).
    """
    if group_size(group) == 1:
        return
    import torch

    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(states, src=src, group=group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _resolve_group(tp: int | None, device_mesh) -> tuple[object, int]:
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"tp={tp!r} must be a positive int")
    if device_mesh is not None:
        group = _group_of(device_mesh)
        size = group_size(group)
        if tp is not None and tp != size:
            raise ValueError(f"tp={tp} but the tp group of device_mesh has {size} ranks; pass tp=None or tp={size}")
        return group, size
    if not (dist.is_available() and dist.is_initialized()):
        if tp in (None, 1):
            return None, 1
        raise ValueError(
            f"tp={tp} needs torch.distributed: launch {tp} processes (torchrun --nproc-per-node "
            f"{tp}, or accelerate launch) and call torch.distributed.init_process_group() first"
        )
    world = dist.get_world_size()
    tp = world if tp is None else tp
    if world % tp:
        raise ValueError(f"tp={tp} does not divide the world size {world}; use a tp degree that divides {world}")
    if tp == world:
        return dist.group.WORLD, tp
    group, _ = dist.new_subgroups(group_size=tp)  # consecutive ranks: tp is the innermost dim
    return group, tp


def _group_of(device_mesh):
    if isinstance(device_mesh, dist.ProcessGroup):
        return device_mesh
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if device_mesh.ndim == 1:
        return device_mesh.get_group()
    if "tp" in names:
        return device_mesh["tp"].get_group()
    raise ValueError(f"device_mesh has dims {names or device_mesh.ndim}; pass a 1-D mesh or one with a 'tp' dim")


class TPRewrite(Rewrite):
    """The layers of real TP (`taco_accel.tp.layers`): this rank's shards, collectives on the group."""

    def embedding(self) -> VocabParallelEmbedding:
        name = self.plan.embedding
        new = VocabParallelEmbedding.from_module(
            self.model.get_submodule(name), group=self.ctx.group, reduce=RegionExit(self.site(name, "fwd"))
        )
        self.swaps.append((name, new))
        return new

    def sequence_split(self, bwd: Site) -> SequenceSplit:
        return SequenceSplit(bwd, self.sp)

    def sequence_gather(self, fwd: Site) -> SequenceGather:
        return SequenceGather(fwd, self.sp)

    def layer_module(self, name: str, module: nn.Module, style) -> None:
        group = self.ctx.group
        if isinstance(style, EnterRegion):
            fwd = self.site(name, "fwd") if self.sp else None
            region = ColumnRegion(RegionEntry(fwd, self.site(name, "bwd"), self.sp), self.ctx.overlap)
            self.regions[name] = region
            self.pre_hooks.append((module, EnterRegionHook(region)))
        elif isinstance(style, Colwise):
            shard = self.shard(style, module, name)
            replicas = self.ctx.sites.plain(f"{self.ctx.short(name)}/replica_grad") if shard.replicas > 1 else None
            new = ColumnParallelLinear.from_module(module, shard=shard, group=group, replica_site=replicas)
            if name.rpartition(".")[0] in self.regions:  # computed by its region, which overlaps its backward
                self.regions[name.rpartition(".")[0]].layers.append(new)
            self.swaps.append((name, new))
        elif isinstance(style, Rowwise):
            reduce = RegionExit(self.site(name, "fwd"), self.site(name, "bwd") if self.sp else None, self.sp,
                                self.ctx.overlap)
            shard = self.shard(style, module, name)
            self.swaps.append((name, RowParallelLinear.from_module(module, shard=shard, group=group, reduce=reduce)))
        else:
            raise TypeError(f"unknown plan style {style!r} for {name}")

    def lm_head(self, embedding: VocabParallelEmbedding) -> ColumnParallelLinear:
        """Split like the embedding (the same parameter when tied); its output is gathered into
        the full logits at the plain site ``lm_head/logits`` (`models.loss`)."""
        name, group = self.plan.lm_head, self.ctx.group
        head = self.model.get_submodule(name)
        tied = head.weight is self.model.get_submodule(self.plan.embedding).weight
        region = ColumnRegion(RegionEntry(None, self.site(name, "bwd")), self.ctx.overlap)
        new = ColumnParallelLinear.from_module(
            head, shard=embedding.shard, group=group, entry=region, gather=self.ctx.sites.plain(f"{name}/logits"),
        )
        region.layers.append(new)
        if tied:
            new.weight = embedding.weight
        self.swaps.append((name, new))
        return new


def _apply_plan(model: nn.Module, plan: TPPlan, ctx: TPContext, logits: str) -> None:
    """Swap the modules named by the plan, add the hooks, install the head and loss."""
    TPRewrite(model, plan, ctx).install()
    ctx.grad_sum_params = _partial_grad_params(model, plan, ctx)
    ctx.install_grad_sums(model)
    ctx.head = install_head(model, logits, site=ctx.sites.plain("loss/lse"))


def _partial_grad_params(model: nn.Module, plan: TPPlan, ctx: TPContext) -> list[str]:
    """Replicated parameters whose gradient each rank computes from part of the data.

    Inside a block's TP region (e.g. Qwen3's q_norm / k_norm on the local heads), and with
    sequence parallelism everything replicated between the split and the final gather (norms,
    row-parallel biases). Their gradients are summed over the group during backward.
    """
    if ctx.tp == 1:
        return []
    sharded = set()
    for module in model.modules():
        for pname in getattr(module, "shards", {}):
            if getattr(module, pname, None) is not None:
                sharded.add(id(getattr(module, pname)))
    parallel = {
        id(p) for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for p in m.parameters()
    }
    if ctx.sequence.enabled:
        scopes = [f"{plan.layers}.", f"{plan.final_norm}."]
    else:
        regions = [rel for rel, style in plan.layer.items() if isinstance(style, EnterRegion)]
        scopes = [f"{plan.layers}.{i}.{rel}." for i in range(len(model.get_submodule(plan.layers))) for rel in regions]
    names = []
    for name, param in model.named_parameters():
        if id(param) in sharded or not any(name.startswith(s) for s in scopes):
            continue
        if ctx.sequence.enabled or id(param) not in parallel:
            names.append(name)
    return names


@contextmanager
def calibrate_group_sizes(model: nn.Module, candidates=GROUP_SIZES, tolerance: float = 0.05, max_elements: int = 2**16):
    """Data-driven reshaping: while the block runs (a few training steps), every compressed
    site keeps a sample of what it sends; on exit each site's group size is picked with
    `codec.calibrate` (the smallest choice over the ranks) and applied. Yields the `SiteTable`::

        with taco_accel.calibrate_group_sizes(model):
            for batch in first_batches:
                model(**batch).loss.backward()
        print(model.taco.sites)
        model.taco.sites.save("group_sizes.json")
    """
    sites = context_of(model).sites
    sites.start_recording(max_elements)
    try:
        yield sites
    except BaseException:
        sites.stop_recording()
        raise
    sites.calibrate(candidates, tolerance)
