"""``parallelize(model, tp=N, emulate=True)``: a causal LM rewritten into N emulated TP ranks.

The same plan, the same checks (a tp that does not divide the heads raises the ValueError of
real TP), the same communication sites with the same names, settings and statistics, as
`parallelize` without ``emulate``; the layers are those of `taco_accel.tp.emulate`, which keep
the full parameters and compute every rank's share in this one process. Attention modules
get the total head counts of the emulated layout (tp times the local counts: a replicated kv
head counts once per rank), so that each rank's query heads use their own kv copy.

The loss is the vocab-parallel cross-entropy of real TP, computed rank by rank from the full
logits; the lm head always returns the full logits (``model.taco.logits`` is ``"full"``).
What real TP moves outside the site table, always uncompressed (the loss's all-gather of
log-sum-exps, the gradient sums of replicated weights), the emulation computes in place,
exactly, and records no statistics for.
"""

from __future__ import annotations

import logging

from torch import nn

from ..comm.emulated import EmulatedGroup
from ..tp.emulate import (
    EmulatedColumnParallelLinear,
    EmulatedEntry,
    EmulatedExit,
    EmulatedRegion,
    EmulatedRowParallelLinear,
    EmulatedSequenceGather,
    EmulatedSequenceSplit,
    EmulatedVocabParallelEmbedding,
    emulated_vocab_parallel_cross_entropy,
)
from ..tp.regions import SequenceState
from ..tp.sites import Compression, Site, SiteTable
from .loss import CausalLMLoss
from .parallelize import TPContext, _check_tp, _install_loss, _Rewrite, _shard
from .plan import Colwise, EnterRegion, Rowwise, TPPlan

logger = logging.getLogger(__name__)


def emulate_tp(model: nn.Module, plan: TPPlan, tp, compression, sequence_parallel: bool, device_mesh) -> nn.Module:
    """The ``emulate=True`` branch of `parallelize` (arguments as there, already resolved plan)."""
    if tp is None or isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"emulate=True needs the number of ranks to emulate: pass tp=<int >= 1>, got tp={tp!r}")
    if device_mesh is not None:
        raise ValueError("emulate=True runs every rank in this process: pass device_mesh=None")
    _check_tp(model, plan, tp)
    compression = Compression.resolve(compression)
    group = EmulatedGroup(tp)
    context = TPContext(
        plan, None, tp, 0, compression, SiteTable(None, compression, timed=False),
        SequenceState(bool(sequence_parallel), tp), logits="full", emulator=group,
    )
    _EmulatedRewrite(model, plan, context).install()
    model.taco = context
    logger.info(
        "emulated tensor parallel %s: tp=%d in one process, sequence_parallel=%s, %s",
        plan.name, tp, context.sequence_parallel, context.sites.summary(),
    )
    return model


class EmulatedCausalLMLoss(CausalLMLoss):
    """`CausalLMLoss` of real TP on the full logits of an emulated model: the vocab-parallel
    cross-entropy, each virtual rank on its vocabulary slice (transformers' loss at tp=1)."""

    def full_logits(self, logits, vocab_size: int) -> bool:
        return self.lm_head.tp == 1

    def token_losses(self, logits, shift_labels, ignore_index: int):
        return emulated_vocab_parallel_cross_entropy(logits, shift_labels, self.lm_head.split, ignore_index)


class _EmulatedRewrite(_Rewrite):
    """The module swaps and hooks of one emulated `parallelize`; sites in forward order, with
    the names real TP gives them."""

    def __init__(self, model: nn.Module, plan: TPPlan, ctx: TPContext) -> None:
        super().__init__(model, plan, ctx)
        self.group = ctx.emulator

    def embedding(self) -> EmulatedVocabParallelEmbedding:
        name = self.plan.embedding
        reduce = EmulatedExit(self.group, self.site(name, "fwd"))
        new = EmulatedVocabParallelEmbedding(self.model.get_submodule(name), self.group, reduce=reduce)
        self.swaps.append((name, new))
        return new

    def layers(self) -> None:
        plan, tp = self.plan, self.ctx.tp
        layers = self.model.get_submodule(plan.layers)
        if self.sp is not None:
            split = EmulatedSequenceSplit(self.group, self.site(f"{plan.layers}.0", "bwd"), self.sp)
            self.pre_hooks.append((layers[0], split))
        local_q, local_kv = self.dims.num_heads // tp, max(self.dims.num_kv_heads // tp, 1)
        for index, layer in enumerate(layers):
            regions: dict[str, EmulatedRegion] = {}  # EnterRegion module name -> its region
            for rel, style in plan.layer.items():
                self.layer_module(f"{plan.layers}.{index}.{rel}", layer.get_submodule(rel), style, regions)
            plan.set_local_heads(layer.get_submodule(plan.attention), tp * local_q, tp * local_kv)
        if self.sp is not None:
            final_norm = self.model.get_submodule(plan.final_norm)
            gather = EmulatedSequenceGather(self.group, self.site(plan.final_norm, "fwd"), self.sp)
            self.post_hooks.append((final_norm, gather))

    def layer_module(self, name: str, module: nn.Module, style, regions: dict[str, EmulatedRegion]) -> None:
        """Swap or hook one module of a layer (``regions``: the layer's regions met so far)."""
        rel = name.rsplit(".", 1)[-1]
        if isinstance(style, EnterRegion):
            fwd = self.site(name, "fwd") if self.sp else None
            regions[name] = EmulatedRegion(EmulatedEntry(self.group, fwd, self.site(name, "bwd"), self.sp))
            self.pre_hooks.append((module, regions[name]))
        elif isinstance(style, Colwise):
            split = _shard(style, module, self.dims, self.ctx.tp, rel)
            region = next((r for prefix, r in regions.items() if name.startswith(prefix + ".")), None)
            self.swaps.append((name, EmulatedColumnParallelLinear(module, split, self.group, region=region)))
        elif isinstance(style, Rowwise):
            fwd = self.site(name, "fwd")  # sites are created in real TP's order: fwd, then bwd
            reduce = EmulatedExit(self.group, fwd, self.site(name, "bwd") if self.sp else None, self.sp)
            split = _shard(style, module, self.dims, self.ctx.tp, rel)
            self.swaps.append((name, EmulatedRowParallelLinear(module, split, self.group, reduce=reduce)))
        else:
            raise TypeError(f"unknown plan style {style!r} for {name}")

    def lm_head(self, embedding: EmulatedVocabParallelEmbedding) -> EmulatedColumnParallelLinear:
        """Split like the embedding; the parameter objects stay those of the model (tying kept)."""
        name = self.plan.lm_head
        entry = EmulatedEntry(self.group, None, self.site(name, "bwd"))
        new = EmulatedColumnParallelLinear(self.model.get_submodule(name), embedding.split, self.group, entry=entry)
        self.swaps.append((name, new))
        return new

    def install(self) -> None:
        """Build everything first (an error leaves the model untouched), then swap and hook."""
        embedding = self.embedding()
        self.layers()
        head = self.lm_head(embedding)
        self.apply()
        _install_loss(self.model, EmulatedCausalLMLoss(head, Site("loss/lse", None, None),
                                                       getattr(self.model, "_loss_function", None)))
