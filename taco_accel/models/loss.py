"""The causal-LM head of a parallelised model: full logits out, vocab-parallel loss inside, or the
head and loss fused.

transformers' causal LMs compute ``logits = lm_head(hidden)`` and then
``loss = self.loss_function(logits, labels, vocab_size, ...)``, and return both. `parallelize`
installs a few small pieces around that code, which it does not change:

- `LogitsGather`, a forward hook on the lm head: it all-gathers this rank's vocabulary slice
  (b, s, V/tp) into the full logits (b, s, V), transformers' convention, whenever a user can
  see them. The gather is differentiable (forward: all-gather, backward: keep this rank's
  slice; `ColumnParallelLinear.gather_outputs`), so a loss computed from ``outputs.logits``
  trains right: every TP rank computes the same loss from the same full logits.
- `CausalLMLoss` as ``model.loss_function``: the vocab-parallel cross-entropy on this rank's
  slice, never on the gathered tensor (the slice the head computed is kept beside the full
  logits, so the loss's backward does not run through the gather), or, when the head handed
  its input on (`FusedHead`), the fused head and loss (`tp.fused_cross_entropy`). Labels
  outside the vocabulary (other than ``ignore_index``) raise an IndexError on every rank, as
  ``F.cross_entropy`` does (`checks.check_labels`).
- `FusedHead`, asked by the head's forward (``head.fused``) whether to hand its input on
  instead of multiplying it (``logits="none"`` with labels), and `LogitsModeHook`, a forward
  pre-hook on the model: it tells both whether this forward has ``labels``, validates the mode,
  and after the forward leaves ``outputs.logits`` None where the fused loss ran.

``logits`` (`LogitsMode`, ``model.taco.logits``, `parallelize`'s and the Accelerator's
``logits=``): ``"full"`` (default) returns the full logits always; ``"local"`` saves the
all-gather and the (b, s, V) tensor when ``labels`` are given: ``outputs.logits`` is then this
rank's vocabulary slice (b, s, V/tp) and only ``outputs.loss`` is meaningful as a whole;
``"none"`` computes no logits when ``labels`` are given: the head's matmul, the loss and their
gradients run in chunks of tokens (`tp.fused_cross_entropy`: no (tokens, V/tp) tensor beyond one
chunk), ``outputs.loss`` is the same loss to fp32 rounding and ``outputs.logits`` is None (the
project's Trainer, Finetuner and `taco_trainer`'s training steps use it). Without labels
(generation, evaluation from logits) the logits are full in every mode. Pipeline stages call the
head directly: the last stage returns full logits under ``"full"`` (a custom ``loss_fn`` sees
what a user would), this rank's slice under ``"local"``, and its final hidden states under
``"none"``, which the model's own loss function turns into the fused loss. An emulated model
(``emulate=True``) holds every rank in one process: its logits are full under ``"full"`` and
``"local"``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..tp.cross_entropy import vocab_parallel_cross_entropy
from ..tp.fused_cross_entropy import EAGER, ChunkKernels, fused_linear_cross_entropy
from ..tp.mappings import gather_from_tp_region
from ..tp.sites import Site
from .checks import check_labels

LogitsMode = Literal["full", "local", "none"]
LOGITS_MODES: tuple[str, ...] = ("full", "local", "none")


def check_logits_mode(mode) -> str:
    """``mode`` itself when it is one of `LOGITS_MODES`; a TypeError / ValueError naming them otherwise."""
    if not isinstance(mode, str):
        raise TypeError(f"logits={mode!r} must be a str, one of {LOGITS_MODES}")
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits={mode!r}: use one of {LOGITS_MODES} ('full': transformers' full-vocabulary "
                         "logits, the default; 'local': this rank's vocabulary slice when labels are given; 'none': "
                         "no logits when labels are given, the head and loss fused)")
    return mode


class LogitsGather:
    """Forward hook on the lm head (a `ColumnParallelLinear`) of real TP: the full logits.

    Keeps ``(full, local)`` of its last gather until the loss takes the local slice
    (`local_part`) or the model's next forward starts (`LogitsModeHook` clears it).
    """

    def __init__(self, context) -> None:
        self.context = context
        self.labels: bool | None = None  # this forward has labels; None: unknown (a pipeline stage)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, head: nn.Module, args, local: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None
        self.kept = None
        if self.context.logits != "full" and labels is not False:
            return local  # (b, s, V/tp), or under "none" the head's input: the loss follows
        full = head.gather_outputs(local)  # (b, s, V), rank order
        self.kept = (full, local)
        return full

    def local_part(self, head: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of ``logits``: the head's own local output when ``logits``
        is its last gathered output, a slice of other full logits, or ``logits`` if already local."""
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] is logits:
            return kept[1]
        if logits.shape[-1] != head.out_features:
            return logits
        ((start, stop),) = head.shard.ranges[head.rank]
        return logits.narrow(-1, start, stop - start)  # its backward: zeros but for this rank's slice


class FusedHead:
    """Under ``logits="none"``: whether the lm head hands its input on instead of multiplying it,
    what it handed on, and the chunk kernels of the fused loss (`tp.fused_cross_entropy`).

    The head's forward asks `defers` (``head.fused``): yes when this forward's loss follows, i.e.
    `LogitsModeHook` saw ``labels`` or a pipeline's last stage said so (``labels = True``).
    The loss function `take` s what was handed on; a forward whose handed-on input no loss took
    raises (its ``logits`` would be hidden states)."""

    def __init__(self, context) -> None:
        self.context = context
        self.labels = False  # the loss follows this forward (set before each forward)
        self.kept: tuple[nn.Module, torch.Tensor] | None = None  # (head, its input), handed on
        self.ran = False  # the fused loss ran in this forward
        self.kernels = EAGER
        self.chunk: int | None = None  # tokens per chunk; None: `fused_cross_entropy.chunk_tokens`

    def defers(self) -> bool:
        labels, self.labels = self.labels, False
        return labels and self.context.logits == "none"

    def keep(self, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.kept = (head, x)
        return x

    def take(self, logits: torch.Tensor) -> tuple[nn.Module, torch.Tensor] | None:
        """``(head, hidden states)`` when ``logits`` is what the head handed on, else None."""
        kept = self.kept
        if kept is None or kept[1] is not logits:
            return None
        self.kept, self.ran = None, True
        return kept

    def compile(self, backend: str | None) -> None:
        """Compile the chunk arithmetic with ``backend`` (None: eager), as the model is compiled."""
        self.kernels = EAGER if backend is None else ChunkKernels(backend)


class CausalLMLoss:
    """transformers' ``ForCausalLMLoss`` (shift, ignore_index, num_items_in_batch) computed on
    this rank's vocabulary slice (`vocab_parallel_cross_entropy`; transformers' own at tp=1), or
    over the hidden states the head handed on (``fused``, `fused_linear_cross_entropy`)."""

    def __init__(self, lm_head: nn.Module, site: Site, fallback=None, gather: LogitsGather | None = None) -> None:
        if fallback is None:
            from transformers.loss.loss_utils import ForCausalLMLoss as fallback
        self.lm_head, self.site, self.fallback, self.gather = lm_head, site, fallback, gather
        self.fused: FusedHead | None = None  # `install_logits_mode` sets it

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
        ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs,
    ) -> torch.Tensor:
        handed_on = self.fused.take(logits) if self.fused is not None else None
        if handed_on is None and self.lm_head.tp == 1:
            return self.fallback(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )
        if shift_labels is None:  # tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        check_labels(shift_labels, logits, vocab_size, ignore_index)  # a label with no row raises
        if handed_on is not None:
            total = self.fused_loss(*handed_on, shift_labels, ignore_index)
        else:
            logits = self.loss_input(logits)
            total = self.token_losses(logits, shift_labels, ignore_index).sum()
        if num_items_in_batch is None:
            return total / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    def loss_input(self, logits: torch.Tensor) -> torch.Tensor:
        """What `token_losses` reads: this rank's vocabulary slice (b, s, V/tp)."""
        if self.gather is None:
            return logits
        return self.gather.local_part(self.lm_head, logits)

    def token_losses(self, logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Per-token loss (0 where ignored) from this rank's vocabulary slice of the logits."""
        vocab_start = self.lm_head.shard.ranges[self.lm_head.rank][0][0]
        return vocab_parallel_cross_entropy(logits, shift_labels, vocab_start, self.site, ignore_index)

    def fused_loss(self, head: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor,
                   ignore_index: int) -> torch.Tensor:
        """The summed loss of ``head`` over ``hidden`` (b, s, h), fused (`fused_linear_cross_entropy`)."""
        xs, weights, biases, starts, gather_parts = self.fused_inputs(head, hidden)
        return fused_linear_cross_entropy(xs, weights, shift_labels.reshape(-1), starts, gather_parts, biases=biases,
                                          ignore_index=ignore_index, chunk=self.fused.chunk, kernels=self.fused.kernels)

    def fused_inputs(self, head: nn.Module, hidden: torch.Tensor) -> tuple:
        """What `fused_linear_cross_entropy` reads of ``head`` (this rank's): the input after the
        head's region entry (its backward: the input gradient's all-reduce at ``lm_head/bwd``) as
        (tokens, h), the weight rows (V/tp, h) and bias as the head multiplies them, its first
        vocabulary row, and the all-gather of the loss parts at the plain site ``loss/lse``."""
        entry = getattr(head.entry, "entry", head.entry)  # the region's entry: no overlap computing logits
        x = entry(hidden) if entry is not None else hidden
        weight, bias = head.region_params()
        weight = weight.t() if head.conv1d else weight
        start = head.shard.ranges[head.rank][0][0]
        return ([x.reshape(-1, x.shape[-1])], [weight], [bias], [start],
                lambda parts: gather_from_tp_region(parts, self.site, dim=0))


class LogitsModeHook:
    """Forward pre-hook on the causal LM: validates ``context.logits`` and tells ``gather`` and
    ``fused`` whether this forward has ``labels``; `after` (a forward hook) leaves the output's
    logits None where the fused loss ran."""

    def __init__(self, model: nn.Module, gather: LogitsGather | None, fused: FusedHead, context) -> None:
        self.gather, self.fused, self.context = gather, fused, context
        params = [
            p.name for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.labels_index = params.index("labels") if "labels" in params else None

    def __call__(self, module, args, kwargs):
        check_logits_mode(self.context.logits)
        labels = kwargs.get("labels")
        if labels is None and self.labels_index is not None and len(args) > self.labels_index:
            labels = args[self.labels_index]
        if self.gather is not None:
            self.gather.kept = None
            self.gather.labels = labels is not None
        self.fused.kept, self.fused.ran = None, False
        self.fused.labels = labels is not None

    def after(self, module, args, output):
        fused = self.fused
        if fused.kept is not None:
            fused.kept = None
            raise RuntimeError(f"{type(module).__name__}.forward passed labels but computed no loss from the lm "
                               "head's output, which under logits='none' is the hidden states: set "
                               "model.taco.logits = 'full' for this model")
        if not fused.ran:
            return output
        fused.ran = False
        if isinstance(output, tuple):  # return_dict=False: (loss, logits, ...) without the logits
            return output[:1] + output[2:]
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})


@contextlib.contextmanager
def logits_mode(model: nn.Module, mode: LogitsMode):
    """``model.taco.logits = mode`` inside the block (the previous mode after it); a model that is
    not parallelised (``model.taco`` absent, peft wrappers looked through) as it is."""
    context = getattr(model, "taco", None)
    if context is None:
        yield
        return
    previous, context.logits = context.logits, check_logits_mode(mode)
    try:
        yield
    finally:
        context.logits = previous


def install_logits_mode(model: nn.Module, head: nn.Module, loss: CausalLMLoss, context,
                        gather: LogitsGather | None = None) -> FusedHead:
    """The pieces of ``context.logits`` on a parallelised ``model`` (real or emulated): the
    `FusedHead` its ``head`` and ``loss`` share (kept at ``context.fused``), `LogitsModeHook`
    before and after each forward."""
    fused = FusedHead(context)
    head.fused = loss.fused = context.fused = fused
    hook = LogitsModeHook(model, gather, fused, context)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    model.register_forward_hook(hook.after)
    return fused
