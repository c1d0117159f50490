"""``parallelize(model, tp=N, emulate=True)``: a causal LM rewritten into N emulated TP ranks.

The same plan, the same checks (a tp that does not divide the heads raises the ValueError of
real TP; token ids outside the vocabulary and a GPT-2 sequence past its learned positions raise
the IndexError naming the limit, as in real TP: `checks.install_input_checks` without a group),
the same communication sites with the same names, settings and statistics, as
`parallelize` without ``emulate``; the layers are those of `taco_accel.tp.emulate`, which keep
the full parameters and compute every rank's share in this one process. Attention modules
get the total head counts of the emulated layout (tp times the local counts: a replicated kv
head counts once per rank), so that each rank's query heads use their own kv copy.

The head and loss are real TP's (`models.loss`), each virtual rank on its vocabulary slice; the lm
head returns the full logits in every ``logits`` mode (one process holds every rank's slice: there
is no local one to return).
What real TP moves outside the site table, always uncompressed (the loss's all-gather of
log-sum-exps, the gradient sums of replicated weights), the emulation computes in place,
exactly, and records no statistics for.

The emulation is one slice through the layers, each part public to the one above:
`taco_accel.comm.emulated` (`EmulatedGroup`: the collectives of P ranks on lists of tensors),
`taco_accel.tp.emulate` (the emulated layers, entries, exits and sequence hooks), and this
module (`EmulatedRewrite`, `emulate_tp`), which builds on the walk, shards, checks and loss
installation that real TP uses too (`rewrite`). `parallelize` calls `emulate_tp`.
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
)
from ..tp.regions import SequenceState
from ..comm.policy import Compression
from ..tp.sites import Site, SiteTable
from .checks import install_input_checks
from .context import TPContext
from .loss import install_head
from .plan import Colwise, EnterRegion, Rowwise, TPPlan
from .rewrite import Rewrite, check_tp

logger = logging.getLogger(__name__)


def emulate_tp(model: nn.Module, plan: TPPlan, tp, compression: Compression, sequence_parallel: bool, device_mesh,
               logits: str = "full") -> nn.Module:
    """The ``emulate=True`` branch of `parallelize` (arguments as there, plan and compression resolved)."""
    if tp is None or isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"emulate=True needs the number of ranks to emulate: pass tp=<int >= 1>, got tp={tp!r}")
    if device_mesh is not None:
        raise ValueError("emulate=True runs every rank in this process: pass device_mesh=None")
    check_tp(model, plan, tp)
    group = EmulatedGroup(tp)
    context = TPContext(
        plan, None, tp, 0, compression, SiteTable(None, compression, timed=False),
        SequenceState(bool(sequence_parallel), tp), emulator=group,
    )
    EmulatedRewrite(model, plan, context).install()
    context.sites.plain("loss/lse")  # real TP's site, in its order; the emulated loss parts need no exchange
    install_input_checks(model, plan, None, same_batch=False)  # one process: nothing to compare over a group
    context.head = install_head(model, logits)
    model.taco = context
    logger.info(
        "emulated tensor parallel %s: tp=%d in one process, sequence_parallel=%s, %s",
        plan.name, tp, context.sequence_parallel, context.sites.summary(),
    )
    return model


class EmulatedRewrite(Rewrite):
    """The layers of `taco_accel.tp.emulate` on the `EmulatedGroup` ``ctx.emulator``: every
    rank's share in this process; sites in forward order, with the names real TP gives them."""

    def __init__(self, model: nn.Module, plan: TPPlan, ctx: TPContext) -> None:
        super().__init__(model, plan, ctx)
        self.group = ctx.emulator

    def embedding(self) -> EmulatedVocabParallelEmbedding:
        name = self.plan.embedding
        reduce = EmulatedExit(self.group, self.site(name, "fwd"))
        new = EmulatedVocabParallelEmbedding(self.model.get_submodule(name), self.group, reduce=reduce)
        self.swaps.append((name, new))
        return new

    def sequence_split(self, bwd: Site) -> EmulatedSequenceSplit:
        return EmulatedSequenceSplit(self.group, bwd, self.sp)

    def sequence_gather(self, fwd: Site) -> EmulatedSequenceGather:
        return EmulatedSequenceGather(self.group, fwd, self.sp)

    def attention_heads(self) -> tuple[int, int]:
        """The total head counts of the emulated layout: tp times one rank's (a replicated kv
        head once per rank, so that each rank's query heads use their own kv copy)."""
        num_heads, num_kv_heads = super().attention_heads()
        return self.ctx.tp * num_heads, self.ctx.tp * num_kv_heads

    def layer_module(self, name: str, module: nn.Module, style) -> None:
        if isinstance(style, EnterRegion):
            fwd = self.site(name, "fwd") if self.sp else None
            self.regions[name] = EmulatedRegion(EmulatedEntry(self.group, fwd, self.site(name, "bwd"), self.sp))
            self.pre_hooks.append((module, self.regions[name]))
        elif isinstance(style, Colwise):
            split, region = self.shard(style, module, name), self.region_of(name)
            self.swaps.append((name, EmulatedColumnParallelLinear(module, split, self.group, region=region)))
        elif isinstance(style, Rowwise):
            fwd = self.site(name, "fwd")  # sites are created in real TP's order: fwd, then bwd
            reduce = EmulatedExit(self.group, fwd, self.site(name, "bwd") if self.sp else None, self.sp)
            split = self.shard(style, module, name)
            self.swaps.append((name, EmulatedRowParallelLinear(module, split, self.group, reduce=reduce)))
        else:
            raise TypeError(f"unknown plan style {style!r} for {name}")

    def region_of(self, name: str) -> EmulatedRegion | None:
        """The region of the nearest EnterRegion module that contains ``name``, if any."""
        parent = name.rpartition(".")[0]
        while parent and parent not in self.regions:
            parent = parent.rpartition(".")[0]
        return self.regions.get(parent)

    def lm_head(self, embedding: EmulatedVocabParallelEmbedding) -> EmulatedColumnParallelLinear:
        """Split like the embedding; the parameter objects stay those of the model (tying kept)."""
        name = self.plan.lm_head
        entry = EmulatedEntry(self.group, None, self.site(name, "bwd"))
        new = EmulatedColumnParallelLinear(self.model.get_submodule(name), embedding.split, self.group, entry=entry)
        self.swaps.append((name, new))
        return new
