"""Pipeline parallelism with ``torch.distributed.pipelining``: split, prune, schedule.

torchtitan's recipe, for transformers models: every rank builds the whole model, keeps the
layers of its own stage(s) and drops the rest (`prune_to_stage`), so layer indices and
state_dict keys survive (``model.layers.7.*`` stays ``model.layers.7.*`` on whichever stage owns
layer 7). The first stage keeps the embedding, the last the final norm and the head; the loss
is computed on the last stage by the schedule.

Stage ``s`` of ``pp * v`` lives on pipeline rank ``s % pp`` ("looped" placement), so with
``v = stages_per_rank > 1`` every rank holds v non-adjacent stages (interleaved schedules).

What crosses a stage boundary between ranks goes through the codec like a TP collective (sites
``pp.<b>-<b+1>/fwd`` and ``/bwd``: `boundary`); `emulate_boundaries` applies the same round trip at
the stage cuts of a model that runs in one process.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.p2p import round_trip_message
from ..comm.policy import DEFAULT_COMPRESSION, Compression, CompressionLike, check_same
from ..models.loss import hidden_logits, hidden_loss
from ..tp.sites import SiteTable
from .boundary import BoundaryStage, attach_boundaries, boundary_name
from .stage import StageModule, decoder_layers, family_of
from .transfer import to_device

logger = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stage_costs(config, seq_len: int = 2048) -> tuple[float, float]:
    """(embedding cost, head cost) in decoder-layer units, for `split_layers`.

    A layer costs about ``24 h^2 + 4 s h`` forward FLOPs per token (dense MLP of 4h assumed
    when the config has no intermediate size), the head ``2 h V`` plus the loss. The embedding
    lookup is cheap in FLOPs but holds as many parameters (and optimizer state) as the head:
    it counts as one layer, as in torchtitan.
    """
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    mlp_matrices = 3 if getattr(config, "model_type", "") != "gpt2" else 2
    layer = 2 * (4 * h * h + mlp_matrices * h * inter) + 4 * seq_len * h
    head = 2 * h * config.vocab_size
    return 1.0, max(head / layer, 0.25)


def split_layers(num_layers: int, num_stages: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the most expensive stage.

    The first stage also pays ``embed_cost`` and the last ``head_cost`` (in layer units).
    Every stage gets at least one layer.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages (each needs a layer); "
            "lower pp (or stages_per_rank) or use a deeper model"
        )
    # dp[k][i]: best max-cost splitting the first i layers into k stages (k-th stage ends at i)
    inf = float("inf")

    def cost(k: int, lo: int, hi: int) -> float:
        return (hi - lo) + (embed_cost if k == 0 else 0.0) + (head_cost if k == num_stages - 1 else 0.0)

    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for i in range(1, num_layers + 1):
        best[0][i] = cost(0, 0, i)
    for k in range(1, num_stages):
        for i in range(k + 1, num_layers + 1):
            for j in range(k, i):
                value = max(best[k - 1][j], cost(k, j, i))
                if value < best[k][i] - 1e-12:  # ties keep the earliest cut: later stages get more
                    best[k][i], cut[k][i] = value, j
    bounds, i = [num_layers], num_layers
    for k in range(num_stages - 1, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(num_stages)]


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters and children, with its own child dicts."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def prune_to_stage(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A view of ``model`` that holds only ``layers`` (a ModuleDict keyed by global index), the
    embedding if ``is_first`` and the final norm and head if ``is_last``. ``model`` itself is
    left intact; the view shares its parameters."""
    fam = family_of(model)
    top = _shallow(model)
    base = _shallow(getattr(model, fam.base))
    setattr(top, fam.base, base)
    full = getattr(base, fam.layers)
    setattr(base, fam.layers, nn.ModuleDict({str(i): full[i] for i in layers}))
    if not is_first:
        for name in (fam.embed, fam.position_embed):
            if name:
                setattr(base, name, None)
    if not is_last:
        setattr(base, fam.norm, None)
        top.lm_head = None
    if is_last and not is_first and is_tied(model):
        # The head of a tied model lives on another rank than the embedding: give it its own
        # copy, kept equal by `TiedEmbeddingSync` (Megatron's embedding group).
        top.lm_head = _shallow(model.lm_head)
        top.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return top


def is_tied(model: nn.Module) -> bool:
    """Whether the head shares its weight with the token embedding."""
    fam = family_of(model)
    embed = getattr(getattr(model, fam.base), fam.embed, None)
    head = getattr(model, "lm_head", None)
    return embed is not None and head is not None and head.weight is embed.weight


@dataclass
class PipelinePlan:
    """Which stages this rank runs: ``stage_ids`` and their ``StageModule``s, in order."""

    num_stages: int
    stage_ids: list[int]
    modules: list[StageModule]
    layer_ranges: list[range]


def apply_pp(model: nn.Module, mesh: DeviceMesh, stages_per_rank: int = 1, *, seq_len: int = 2048,
             sequence_parallel: bool = False, compression: CompressionLike = DEFAULT_COMPRESSION) -> PipelinePlan:
    """Split ``model`` into ``pp * stages_per_rank`` stages; return the ones of this rank.

    With pp=1 and one stage per rank this is the whole model as one `StageModule`. With
    ``sequence_parallel`` the activations sent between stages hold 1/tp of the tokens. Each
    stage module gets its pipeline boundaries (`boundary.attach_boundaries`: the sites
    ``pp.<b>-<b+1>/fwd`` and ``/bwd``, with the settings of the model's own `Compression` when it
    is tensor parallel, which ``compression`` may repeat but not change (a `ConfigError`), else
    of ``compression``). A collective on every rank.
    """
    compression = Compression.resolve(compression)
    context = getattr(model, "taco", None)
    if context is not None:
        check_same(compression, context.compression, "apply_pp")
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    num_stages = pp * stages_per_rank
    embed_cost, head_cost = stage_costs(model.config, seq_len)
    ranges = split_layers(model.config.num_hidden_layers, num_stages, embed_cost, head_cost)
    stage_ids = list(range(pp_rank, num_stages, pp))
    modules = []
    for s in stage_ids:
        first, last = s == 0, s == num_stages - 1
        view = model if num_stages == 1 else prune_to_stage(model, ranges[s], first, last)
        seq_split = mesh["tp"].size() if sequence_parallel else 1
        modules.append(StageModule(view, is_first=first, is_last=last, seq_split=seq_split))
    attach_boundaries(modules, stage_ids, num_stages, mesh, compression,
                      None if context is None else context.sites)
    logger.info(
        "applied pipeline parallelism: %d stage(s), layers per stage %s, this rank runs stage(s) %s",
        num_stages, [len(r) for r in ranges], stage_ids,
    )
    return PipelinePlan(num_stages, stage_ids, modules, ranges)


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn):
    """A ``torch.distributed.pipelining`` schedule over this rank's ``PipelineStage``s.

    ``"gpipe"``: all forwards then all backwards; ``"1f1b"``: one forward one backward in the
    steady state (less activation memory); ``"interleaved_1f1b"``: 1F1B over several stages
    per rank (smaller bubble; needs ``stages_per_rank > 1``).
    """
    from torch.distributed import pipelining as pl

    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not supported; use one of {SCHEDULES}")
    if name == "interleaved_1f1b":
        return pl.ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank, got {len(stages)}; use interleaved_1f1b")
    cls = pl.ScheduleGPipe if name == "gpipe" else pl.Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)


class _Cut(torch.autograd.Function):
    """Identity with the boundary's codec round trip: the forward channel on the value, the
    backward channel on its gradient."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return round_trip_message(fwd, x).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return round_trip_message(ctx.bwd, grad), None, None


def emulate_boundaries(model: nn.Module, num_stages: int, compression: CompressionLike = DEFAULT_COMPRESSION, *,
                       seq_len: int = 2048) -> SiteTable:
    """Send the hidden states at the cuts of a ``num_stages``-stage pipeline of ``model`` (the
    stages `apply_pp` would build: `split_layers` balanced for ``seq_len``) and their gradients
    through the boundary codec, in one process: each cut's ``pp.<b>-<b+1>/fwd`` and ``/bwd`` sites
    (settings from ``compression``, anything `Compression.resolve` takes, ``"auto"`` by default as
    at every entry: here the auto mode's size rule, `comm.policy.UNTIMED_BYTES`, as there is no
    link to time) decode what they would send. Returns the sites' table. Its ledger counts the
    bytes: a parallelised ``model``'s own (``model.taco.sites.ledger``), so that the model's
    figures (`ModelParts.ledgers`, a loop's `comm_totals`) include its boundaries' as they
    include a real pipeline's; else a new one (keep the table to read it). Without sequence
    parallelism: the cut holds every token."""
    context = getattr(model, "taco", None)
    ledger = context.sites.ledger if isinstance(getattr(context, "sites", None), SiteTable) else None
    table = SiteTable(None, Compression.resolve(compression), timed=False, ledger=ledger)
    layers = decoder_layers(model)
    config = getattr(model, "config", None) or model.get_base_model().config
    ranges = split_layers(len(layers), num_stages, *stage_costs(config, seq_len))
    for b in range(num_stages - 1):
        name = boundary_name(b)
        fwd, bwd = table.site(f"{name}/fwd"), table.site(f"{name}/bwd")

        def cut(module, args, output, fwd=fwd, bwd=bwd, table=table):  # the table: its ledger lives with the hook
            if isinstance(output, tuple):
                return (_Cut.apply(output[0], fwd, bwd), *output[1:])
            return _Cut.apply(output, fwd, bwd)

        layers[ranges[b][-1]].register_forward_hook(cut)
    logger.info("emulated pipeline boundaries after layers %s: %s", [r[-1] for r in ranges[:-1]], table.summary())
    return table


def make_pipeline_stages(modules: list[nn.Module], stage_ids: list[int], num_stages: int, mesh: DeviceMesh,
                         device: torch.device) -> list:
    """Wrap each (possibly DP-wrapped) stage module in a `boundary.BoundaryStage` over the pp
    group: a ``PipelineStage`` whose transfers go through the module's boundaries."""
    group = mesh["pp"].get_group()
    return [BoundaryStage(m, s, num_stages, device, group, getattr(m, "inbound", None), getattr(m, "outbound", None))
            for m, s in zip(modules, stage_ids)]


class PipelineRunner:
    """Forward and backward of one batch through this rank's pipeline stages, in micro-batches.

    ``step(input_ids, labels)`` runs the schedule over ``micro_batches`` equal slices of the
    batch (the first stage reads ``input_ids``, the last computes the loss against ``labels``)
    and returns the mean micro-batch loss as a float64 0-d tensor on the device (zero on ranks
    without the last stage); ``eval`` runs forwards only. Gradients accumulate in the stages'
    parameters: finish and clip them with `clip_grad_norm_` (the Accelerator's calls it).
    Around each schedule step the stages' boundaries (`boundary.PipelineBoundaries`) check their
    settings across each link (first step), raise on non-finite messages under ``"raise"`` and
    time undecided auto sites (after the step): every rank runs ``step`` / ``eval`` together.
    The last stage ends in the final norm; its loss is the model's head and loss
    (`models.loss.hidden_loss`: fused under ``logits="none"``, vocab-parallel otherwise); a custom
    ``loss_fn(logits, labels)`` gets the logits (`models.loss.hidden_logits`: full, or this rank's
    vocabulary slice under ``"local"``).
    ``shifted_labels``: the labels already hold the next tokens (packed pretraining windows).
    ``autocast``: a callable returning the context the schedule runs in (the Accelerator's
    ``autocast``: its mixed precision), as a prepared model's forward runs in it.
    """

    def __init__(self, parts, schedule: str, micro_batches: int, device: torch.device, *, loss_fn=None,
                 shifted_labels: bool = False, autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.parts, self.device = parts, device
        self.autocast = autocast or contextlib.nullcontext
        loss_fn = self._stage_loss(loss_fn, shifted_labels)
        self.loss_fn, self.micro_batches, self.schedule = loss_fn, micro_batches, None
        if parts.num_stages > 1:
            stages = make_pipeline_stages(parts.modules, parts.stage_ids, parts.num_stages, parts.mesh, device)
            self.schedule = build_schedule(schedule, stages, micro_batches, loss_fn)
        self.boundaries = getattr(parts.modules[0], "boundaries", None)

    def _stage_loss(self, loss_fn, shifted: bool):
        """``(final hidden states, labels) -> loss`` of the last stage: the model's head and loss, or
        ``loss_fn`` of the logits."""
        last = [m for s, m in zip(self.parts.stage_ids, self.parts.modules) if s == self.parts.num_stages - 1]
        if not last:  # the schedule computes the loss on the last stage only, but wants a function
            return _not_on_this_stage
        model = last[0].model  # the stage's view of the causal LM
        if loss_fn is not None:
            return lambda hidden, labels: loss_fn(hidden_logits(model, hidden), labels)
        if shifted:
            return lambda hidden, labels: hidden_loss(model, hidden, labels, shift_labels=labels)
        return lambda hidden, labels: hidden_loss(model, hidden, labels)

    def parameters(self):
        return self.parts.parameters()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, labels, train=True)

    def eval(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._run(input_ids, labels, train=False)

    def _run(self, input_ids, labels, *, train: bool) -> torch.Tensor:
        args = (to_device(input_ids, self.device),) if self.parts.has_first_stage else ()
        target = to_device(labels, self.device) if self.parts.has_last_stage else None
        losses: list = []
        if self.boundaries is not None:
            self.boundaries.check(self.device)
        with self.autocast():
            if self.schedule is None:
                self._accumulate(args[0], target, losses, train)
            else:
                (self.schedule.step if train else self.schedule.eval)(*args, target=target, losses=losses)
        if self.boundaries is not None:
            self.boundaries.settle(self.device)
        if not self.parts.has_last_stage:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([loss.detach().double() for loss in losses]).mean()

    def _accumulate(self, input_ids, target, losses: list, train: bool) -> None:
        """One stage: gradient accumulation over the micro-batches, as the schedules run it (the
        same slices, the mean gradient) without their per-chunk bookkeeping and per-parameter
        gradient scaling, which cost host time on every step; the loss is scaled instead."""
        module, n = self.parts.modules[0], self.micro_batches
        for ids, labels in zip(input_ids.tensor_split(n), target.tensor_split(n)):
            loss = self.loss_fn(module(ids), labels)
            if train:
                (loss / n).backward()
            losses.append(loss)


def _not_on_this_stage(logits, labels):
    raise AssertionError("the loss is computed on the last pipeline stage")
