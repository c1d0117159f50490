"""The causal LM's head and loss: one forward that computes the loss from the hidden states, at every tp.

transformers' causal LMs compute ``logits = lm_head(hidden)``, then ``loss_function(logits,
labels, ...)``. taco_accel replaces the causal LM's ``forward`` by `CausalLMHead` (as liger-kernel
patches it; torchtitan computes the loss outside the model), on every door that trains a model:
`parallelize` (real and emulated TP), and at tp=1 `Accelerator.prepare`, the recipes' Trainer, the
Finetuner and `taco_trainer` (`install_head`). The forward runs the decoder (the body:
``model.model`` / ``model.transformer``), then, explicitly::

    hidden = body(...).last_hidden_state[logits_to_keep]
    no labels                      -> logits: the full vocabulary (gathered over the tp ranks)
    labels, model.loss_function
      a user's own                 -> logits: the full vocabulary; loss: that function of them
      transformers' default, and logits=
        "none"                     -> loss: the fused head and loss (tp.fused_cross_entropy): no
                                      (tokens, V/tp) tensor beyond one chunk; logits: None
        "local"                    -> logits: this rank's vocabulary slice; loss: vocab-parallel
                                      from it (tp.cross_entropy, chunked)
        "full"                     -> logits: the full vocabulary (differentiable); loss: from the
                                      local slice, as "local"
    TRL's fused_lm_head=True       -> TRL's FusedCausalLMOutput (per-token log-probabilities, ...),
                                      vocab-parallel (`fused_linear_log_probs`) with the settings of
                                      the TRL forward it took the place of

and returns what the class's forward returns (its ``ModelOutput`` class, the body's cache, hidden
states and attentions; a tuple under ``return_dict=False``). transformers' default loss is
``ForCausalLMLoss``: shift (or ``shift_labels``), ``ignore_index``, the sum over
``num_items_in_batch`` or the mean over scored tokens; labels outside the vocabulary raise an
IndexError on every rank (`checks.check_labels`). Without labels (generation, evaluation from
logits) the logits are full in every mode.

The lm head is read as this process holds it (`VocabHead`): a plain ``nn.Linear`` at tp=1 (its loss
parts gathered by the identity), this rank's `ColumnParallelLinear` rows (gathered at the plain site
``loss/lse``), or every virtual rank's rows of an emulated model (whose logits are full in every
mode). Pipeline stages end in the final norm; their loss is `hidden_loss` (a custom ``loss_fn`` gets
`hidden_logits`). The chunk kernels are compiled in one place, `compile_loss`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..tp.cross_entropy import ChunkKernels, EAGER, vocab_parallel_cross_entropy
from ..tp.emulate import EmulatedColumnParallelLinear
from ..tp.fused_cross_entropy import fused_linear_cross_entropy, fused_linear_log_probs
from ..tp.layers import ColumnParallelLinear
from ..tp.mappings import gather_from_tp_region
from ..tp.sites import Site
from ..upstream import transformers as upstream_transformers
from ..upstream import trl as upstream_trl
from .checks import check_labels
from .plan import plan_of_type

logger = logging.getLogger(__name__)

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


# -- the lm head as this process holds it ------------------------------------------------------------

def _identity(parts: torch.Tensor) -> torch.Tensor:
    return parts


class VocabHead:
    """The lm head's rows held here. `logits` (b, s, W): this process's logits; `full`: the full
    vocabulary from them; `shards`: per local rank the (tokens, h) input the head multiplies (its
    backward the head's input gradient sum), its weight rows and bias; ``columns`` / ``vocab_starts``:
    where each local rank's rows lie in `logits` and in the vocabulary; ``gather_parts``: every
    rank's loss parts from the local ones. ``fusable``: the fused loss can read the weights."""

    fusable = True
    columns: list[tuple[int, int]] | None
    vocab_starts: list[int]

    def __init__(self, module: nn.Module, gather_parts=_identity) -> None:
        self.module, self.gather_parts = module, gather_parts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(hidden)

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def shards(self, hidden: torch.Tensor) -> tuple[list, list, list]:
        raise NotImplementedError


class PlainHead(VocabHead):
    """tp=1: the causal LM's own head. An ``nn.Linear`` is fused; any other module (a peft wrapper
    around the head) gives logits, and its loss comes from them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.fusable = type(module) is nn.Linear
        self.columns, self.vocab_starts = None, [0]

    def shards(self, hidden):
        return [hidden.reshape(-1, hidden.shape[-1])], [self.module.weight], [self.module.bias]


class ParallelHead(VocabHead):
    """Real TP: this rank's `ColumnParallelLinear` rows; the loss parts gathered at ``site``."""

    def __init__(self, module: ColumnParallelLinear, site: Site) -> None:
        super().__init__(module, functools.partial(gather_from_tp_region, fwd=site, dim=0))
        ((start, _),) = module.shard.ranges[module.rank]
        self.columns, self.vocab_starts = [(0, module.local_out_features)], [start]

    def full(self, logits):
        return self.module.gather_outputs(logits)  # (b, s, V); backward: this rank's slice

    def shards(self, hidden):
        head = self.module
        entry = getattr(head.entry, "entry", head.entry)  # the region's entry: no overlap computing logits
        x = entry(hidden) if entry is not None else hidden
        weight, bias = head.region_params()
        return [x.reshape(-1, x.shape[-1])], [weight.t() if head.conv1d else weight], [bias]


class EmulatedHead(VocabHead):
    """Emulated TP: every virtual rank's rows of the full head, whose logits are full (rank order)."""

    def __init__(self, module: EmulatedColumnParallelLinear) -> None:
        super().__init__(module)
        self.columns = [(start, stop) for ((start, stop),) in module.split.ranges]
        self.vocab_starts = [start for start, _ in self.columns]

    def shards(self, hidden):
        head = self.module
        xs = [x.reshape(-1, x.shape[-1]) for x in head.entry(hidden)]
        weights = [w.t() if head.conv1d else w for w in head.weight_parts(head.weight)]
        biases = [None] * head.tp if head.bias is None else list(head.bias_parts(head.bias))
        return xs, weights, biases


# -- the forward ------------------------------------------------------------------------------------

def _forward_of(model_class: type) -> tuple[inspect.Signature, str, type]:
    """The class forward's signature, the name of its ``**kwargs`` and its output class."""
    signature = inspect.signature(model_class.forward)
    var = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if "labels" not in signature.parameters or not var:
        raise TypeError(f"{model_class.__name__}.forward({', '.join(signature.parameters)}) takes no labels or no "
                        "**kwargs: not a transformers causal LM forward")
    return signature, var[0], upstream_transformers.causal_lm_output_type(model_class)


def _shift(labels, shift_labels, ignore_index: int) -> torch.Tensor:
    """The next-token targets: ``shift_labels``, else ``labels`` shifted (tokens < n predict n)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _mean(total: torch.Tensor, targets: torch.Tensor, ignore_index: int, num_items_in_batch) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` reduction: over ``num_items_in_batch``, else the scored tokens."""
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class CausalLMHead:
    """The head and loss of one causal LM (the module doc), kept at ``model.taco_head`` and called
    as its ``forward``. ``mode``: the logits mode (``model.taco.logits`` of a parallel model is this);
    ``site``: the plain site of the loss parts' all-gather (real TP); ``kernels`` / ``chunk``: the
    chunk kernels (`compile_loss`) and tokens per chunk (None: `tp.cross_entropy.chunk_tokens`);
    ``trl``: the settings of TRL's fused LM head, once it has been added to the model."""

    def __init__(self, model: nn.Module, mode: str = "full", site: Site | None = None) -> None:
        plan = plan_of_type(getattr(model.config, "model_type", None))
        if plan is None or not is_causal_lm(model):
            raise ValueError(f"{type(model).__name__} is not a causal LM of a supported family; taco_accel's head and "
                             "loss serve transformers causal LMs with a registered plan (taco_accel.supported_model_types())")
        body = getattr(model, plan.base, None)
        if not isinstance(body, nn.Module) or getattr(model, "base_model", body) is not body:
            raise ValueError(f"{type(model).__name__} has no decoder at .{plan.base} (its base_model is "
                             f"{type(getattr(model, 'base_model', None)).__name__}): the head and loss need the body's "
                             "hidden states")
        self.signature, self.var_keyword, self.output_type = _forward_of(type(model))
        # resolved here, outside any forward (torch.compile traces no import of transformers' lazy modules)
        self.slice_hidden = upstream_transformers.logits_slicer()
        self.default_loss = upstream_transformers.default_causal_lm_loss()
        self.mode, self.site = check_logits_mode(mode), site
        self.body_name, self.head_name = plan.base, plan.lm_head
        self.kernels: ChunkKernels = EAGER
        self.chunk: int | None = None
        self.trl: upstream_trl.FusedHeadSettings | None = None
        self.noted_own_loss = False

    # -- pieces -------------------------------------------------------------------------------------
    def vocab_head(self, model: nn.Module) -> VocabHead:
        """The head ``model`` holds now (a pipeline stage's view holds its own copy of a tied head)."""
        head = model.get_submodule(self.head_name)
        if isinstance(head, ColumnParallelLinear):
            if self.site is None:
                raise RuntimeError("a tensor-parallel lm head without the loss's site: the model was parallelised "
                                   "without taco_accel.parallelize")
            return ParallelHead(head, self.site)
        if isinstance(head, EmulatedColumnParallelLinear):
            return EmulatedHead(head)
        return PlainHead(head)

    def __call__(self, model: nn.Module, *args, **kwargs):
        """The causal LM's forward (the module doc)."""
        check_logits_mode(self.mode)
        signature, var, output_type = self.signature, self.var_keyword, self.output_type
        fused_lm_head = kwargs.pop(upstream_trl.FUSED_KEYWORD, False)
        return_dict = kwargs.pop("return_dict", None)
        arguments = signature.bind(model, *args, **kwargs).arguments
        arguments.pop(next(iter(signature.parameters)))  # self
        extra = arguments.pop(var, {})
        labels, logits_to_keep = arguments.pop("labels", None), arguments.pop("logits_to_keep", 0)
        if fused_lm_head:
            return self.trl_forward(model, labels, {**arguments, **extra})
        outputs = getattr(model, self.body_name)(**arguments, **extra)
        hidden = self.slice_hidden(outputs.last_hidden_state, logits_to_keep)
        loss, logits = self.head_and_loss(model, hidden, labels, extra)
        fields = {k: v for k, v in outputs.items() if k in output_type.__dataclass_fields__ and k != "last_hidden_state"}
        out = output_type(loss=loss, logits=logits, **fields)
        if return_dict is None:  # as transformers' can_return_tuple
            return_dict = getattr(model.config, "return_dict", True) is not False
        return out if return_dict else out.to_tuple()

    def head_and_loss(self, model: nn.Module, hidden: torch.Tensor, labels, loss_kwargs: dict):
        """``(loss, logits)`` of the hidden states (b, s, h) after the final norm (the module doc)."""
        head = self.vocab_head(model)
        if labels is None:
            return None, head.full(head.logits(hidden))
        own = upstream_transformers.own_loss_function(model, self.default_loss)
        if own is not None:
            self._note_own_loss(model)
            logits = head.full(head.logits(hidden))
            return own(logits, labels, vocab_size=model.config.vocab_size, **loss_kwargs), logits
        if self.mode == "none" and head.fusable:
            return self.fused_loss(model, head, hidden, labels, **loss_kwargs), None
        local = head.logits(hidden)
        loss = self.logits_loss(model, head, local, labels, **loss_kwargs)
        return loss, {"full": head.full(local), "local": local, "none": None}[self.mode]

    def fused_loss(self, model, head: VocabHead, hidden, labels, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **_) -> torch.Tensor:
        """transformers' default loss, the head and loss fused (`fused_linear_cross_entropy`)."""
        targets = _shift(labels, shift_labels, ignore_index).to(hidden.device)
        check_labels(targets, hidden, model.config.vocab_size, ignore_index)
        xs, weights, biases = head.shards(hidden)
        total = fused_linear_cross_entropy(xs, weights, targets.reshape(-1), head.vocab_starts, head.gather_parts,
                                           biases=biases, ignore_index=ignore_index, chunk=self.chunk,
                                           kernels=self.kernels)
        return _mean(total, targets, ignore_index, num_items_in_batch)

    def logits_loss(self, model, head: VocabHead, logits, labels, num_items_in_batch=None, ignore_index: int = -100,
                    shift_labels=None, **_) -> torch.Tensor:
        """transformers' default loss from this process's logits, vocab-parallel (`vocab_parallel_cross_entropy`)."""
        targets = _shift(labels, shift_labels, ignore_index).to(logits.device)
        check_labels(targets, logits, model.config.vocab_size, ignore_index)
        total = vocab_parallel_cross_entropy(logits, targets, head.vocab_starts, head.gather_parts, columns=head.columns,
                                             ignore_index=ignore_index, chunk=self.chunk, kernels=self.kernels).sum()
        return _mean(total, targets, ignore_index, num_items_in_batch)

    def _note_own_loss(self, model: nn.Module) -> None:
        if self.mode != "full" and not self.noted_own_loss:
            logger.warning("%s.loss_function is not transformers' default: it gets the full logits, as transformers "
                           "gives them, and logits=%r saves nothing for this model", type(model).__name__, self.mode)
        self.noted_own_loss = True

    # -- TRL's fused LM head ----------------------------------------------------------------------
    def trl_forward(self, model: nn.Module, labels, body_kwargs: dict):
        """What TRL's fused forward returns (``FusedCausalLMOutput``), vocab-parallel: the body,
        then the per-token figures of the scored positions only."""
        trl = self.trl
        if trl is None:
            raise ValueError(f"{type(model).__name__} was called with {upstream_trl.FUSED_KEYWORD}=True, but no fused LM "
                             "head was added to it (trl.trainer.utils.add_fused_lm_head) before taco_accel took its forward")
        shift_labels = body_kwargs.pop("shift_labels", None)
        num_items_in_batch = body_kwargs.pop("num_items_in_batch", None)
        hidden = getattr(model, self.body_name)(**{**body_kwargs, "use_cache": False}).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(hidden.device)
        mask = labels != -100
        head = self.vocab_head(model)
        if not head.fusable:
            raise ValueError(f"the lm head is a {type(head.module).__name__}: TRL's fused LM head multiplies an "
                             "nn.Linear's weight")
        per_token = self._log_probs(head, hidden[mask], labels[mask], model.config.vocab_size)
        log_probs, entropy, log_sum_sq, mean_logits, top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return trl.output_type(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq,
            mean_logits=mean_logits, is_top1=top1, label_mask=mask, aux_loss=None)

    def _log_probs(self, head: VocabHead, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int):
        trl = self.trl
        device = hidden.device.type
        if trl.cast_lm_head_to_fp32:
            dtype = torch.float32
        else:
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        xs, weights, biases = head.shards(hidden)
        wanted = tuple(name for name in trl.outputs if name != "log_probs")
        return fused_linear_log_probs(xs, weights, targets, head.vocab_starts, head.gather_parts, vocab_size=vocab_size,
                                      dtype=dtype, biases=biases, logit_scale=trl.logit_scale / trl.temperature,
                                      wanted=wanted, chunk=self.chunk, kernels=self.kernels)

    # -- a pipeline's last stage --------------------------------------------------------------------
    def loss(self, model: nn.Module, hidden: torch.Tensor, labels, **loss_kwargs) -> torch.Tensor:
        """The model's loss of its final hidden states (a pipeline's last stage)."""
        return self.head_and_loss(model, hidden, labels, loss_kwargs)[0]


# -- installing it ------------------------------------------------------------------------------------

def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM of a family with a registered plan."""
    plan = plan_of_type(getattr(getattr(model, "config", None), "model_type", None))
    return (plan is not None and isinstance(getattr(model, plan.lm_head, None), nn.Module)
            and hasattr(model, "generate") and "labels" in inspect.signature(type(model).forward).parameters)


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The causal LM inside ``model``: a ``torch.compile`` wrapper's module, a peft model's base model."""
    model = getattr(model, "_orig_mod", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_of(model: nn.Module) -> CausalLMHead | None:
    """The `CausalLMHead` of ``model`` (wrappers looked through), or None."""
    return causal_lm_of(model).__dict__.get("taco_head")


def _taco_forward(model, *args, **kwargs):
    return model.taco_head(model, *args, **kwargs)


def _is_ours(forward) -> bool:
    return getattr(getattr(forward, "__func__", forward), "taco_head_forward", False)


def _reaches_ours(forward) -> bool:
    """Whether ``forward`` is the installed forward or wraps it (``__wrapped__``: Accelerate's wrappers)."""
    return forward is not None and _is_ours(inspect.unwrap(forward, stop=_is_ours))


def _our_forward(model: nn.Module):
    """`CausalLMHead` bound as ``model.forward``, showing the class forward's signature (what
    ``generate`` and the Trainer read) and wrapping nothing (Accelerate's unwrapping stops at it)."""
    forward = types.FunctionType(_taco_forward.__code__, _taco_forward.__globals__, "forward")
    forward.__signature__ = inspect.signature(type(model).forward)
    forward.__doc__, forward.taco_head_forward = type(model).forward.__doc__, True
    return types.MethodType(forward, model)


def _name(function) -> str:
    function = getattr(function, "__func__", function)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__name__)}"


def _take_forward(model: nn.Module, state: CausalLMHead) -> None:
    """Make ``model``'s forward the installed one: in place of the class's, or of TRL's fused forward
    (whose settings ``state`` keeps, so that ``fused_lm_head=True`` runs here); a forward that reaches
    ours through Accelerate's wrappers stays."""
    forward = model.__dict__.get("forward")
    if _reaches_ours(forward):
        return
    if forward is not None:
        settings = upstream_trl.fused_head_settings(forward)
        found = upstream_trl.fused_forward(forward)
        if settings is None or getattr(found, "__func__", found) is not getattr(forward, "__func__", forward):
            raise ValueError(
                f"{type(model).__name__}.forward is replaced on the model ({_name(forward)}): taco_accel computes the "
                "head and loss in the causal LM's forward and would drop that replacement. Parallelise or prepare "
                "the model before wrapping its forward, or wrap the model instead of its forward")
        if settings.final_logit_softcapping is not None:
            raise ValueError("TRL's fused LM head with final_logit_softcapping: taco_accel's vocab-parallel head has "
                             "no softcapping; use a model without it")
        state.trl = settings
        if _reaches_ours(settings.original_forward):  # TRL's head was added on top of ours
            model.forward = settings.original_forward
            return
        if getattr(settings.original_forward, "__func__", None) is not type(model).forward:
            raise ValueError(f"TRL's fused LM head on {type(model).__name__} wraps {_name(settings.original_forward)}, "
                             "not the class's forward: taco_accel would drop it")
    model.forward = _our_forward(model)


def install_head(model: nn.Module, mode: str | None = None, *, site: Site | None = None) -> CausalLMHead:
    """Make the causal LM in ``model`` (a supported transformers causal LM, or a wrapper of one)
    compute its head and loss through `CausalLMHead`; idempotent. ``mode``: the logits mode (None:
    the installed one, "full" for a new one); ``site``: the loss parts' site of real TP. Adopts
    TRL's fused LM head where TRL added one. Returns the `CausalLMHead` (``model.taco_head``)."""
    causal = causal_lm_of(model)
    state = causal.__dict__.get("taco_head")
    if state is None:
        state = CausalLMHead(causal, mode or "full", site)
    else:
        state.mode = check_logits_mode(mode) if mode is not None else state.mode
        state.site = site if site is not None else state.site
    _take_forward(causal, state)
    causal.taco_head = state
    return state


@contextlib.contextmanager
def logits_mode(model: nn.Module, mode: LogitsMode):
    """``mode`` as ``model``'s logits mode inside the block (the previous one after it); a model
    without the installed head (wrappers looked through) as it is."""
    state = head_of(model)
    if state is None:
        yield
        return
    previous, state.mode = state.mode, check_logits_mode(mode)
    try:
        yield
    finally:
        state.mode = previous


def compile_loss(model: nn.Module, backend: str | None) -> None:
    """Compile the chunk kernels of ``model``'s head and loss with ``backend`` (None: eager): the one
    place they are compiled (`tp.cross_entropy.ChunkKernels`). No-op for a model without the head."""
    state = head_of(model)
    if state is not None and getattr(state.kernels, "backend", None) != backend:
        state.kernels = EAGER if backend is None else ChunkKernels(backend)


# -- what other layers read ------------------------------------------------------------------------------

def _required(model: nn.Module) -> tuple[nn.Module, CausalLMHead]:
    """The causal LM in ``model`` and its `CausalLMHead`; a ValueError where it has none."""
    causal = causal_lm_of(model)
    state = causal.__dict__.get("taco_head")
    if state is None:
        raise ValueError(f"{type(causal).__name__} has no taco_accel head and loss; lay it out first "
                         "(taco_accel.parallelize, or Accelerator.prepare)")
    return causal, state


def hidden_loss(model: nn.Module, hidden: torch.Tensor, labels, **loss_kwargs) -> torch.Tensor:
    """``model``'s loss of its final hidden states (b, s, h) (a pipeline's last stage: ``model`` its view)."""
    causal, state = _required(model)
    return state.loss(causal, hidden, labels, **loss_kwargs)


def hidden_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of the final hidden states: the full vocabulary, or this rank's slice under ``"local"``."""
    causal, state = _required(model)
    head = state.vocab_head(causal)
    local = head.logits(hidden)
    return local if state.mode == "local" else head.full(local)


def token_losses(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (b, s), 0 where not scored, of ``model``'s logits (full or this rank's slice)
    against next-token ``targets``."""
    causal, state = _required(model)
    head = state.vocab_head(causal)
    vocab = causal.config.vocab_size
    check_labels(targets, logits, vocab, ignore_index)
    if logits.shape[-1] == vocab:  # full: one rank's view of every row
        head = PlainHead(head.module)
    return vocab_parallel_cross_entropy(logits, targets, head.vocab_starts, head.gather_parts, columns=head.columns,
                                        ignore_index=ignore_index, chunk=state.chunk, kernels=state.kernels)
