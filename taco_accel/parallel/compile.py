"""Activation checkpointing and torch.compile of a model laid out on the mesh, per decoder block
(torchtitan's ``apply_ac`` and ``apply_compile``), and the compile switch.

`enable_activation_checkpointing` wraps the ``forward`` of every decoder layer in
``torch.utils.checkpoint`` (non-reentrant): the layer's activations are dropped after its forward
and recomputed in backward, TP collectives included (a compressed forward recomputes the same
bytes: the codec is deterministic). It needs no transformers method (whose name changed:
``gradient_checkpointing_enable`` before 5.20, ``activation_checkpointing_enable`` after), keeps
the module tree and parameter names, and leaves the layer's hooks outside the checkpoint, as
transformers does. Enable it before `apply_compile`.

`apply_compile` compiles each decoder block on its own, in place (``nn.Module.compile``): the
blocks are instances of one class running the same code, so dynamo traces the block once and every
other block reuses that graph (parameters are graph inputs; nothing per layer is a constant in
it: the TP sites reach their custom ops as tensors, `comm.ops`; a training forward builds no
KV cache, whose update takes the layer index). Compile time does not grow with depth
(tests/test_compile.py counts one graph for every block and no recompile). The module objects, parameters, state_dict keys and hooks stay what they were, so
checkpoints, clipping and the pipeline schedule see the same modules. What lies outside the blocks
(embedding, rotary and mask setup, final norm, head and loss) runs eagerly, but for the loss's chunk
kernels, compiled with the same backend (`models.loss.compile_loss`).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.loss import compile_loss
from .stage import StageModule, decoder_layers

logger = logging.getLogger(__name__)


def compile_backend(compile, device_type: str) -> str | None:
    """The torch.compile backend a run asks for, or None: ``compile`` is True / False, a backend
    name (``"inductor"``, ``"aot_eager"``, ...), or None for the default (inductor on CUDA,
    off elsewhere: on the CPU compiling costs more than it gains for the small models trained there)."""
    if compile is None:
        return "inductor" if device_type == "cuda" else None
    if compile is True:
        return "inductor"
    if compile is False or compile == "no":
        return None
    if not isinstance(compile, str):
        raise TypeError(f"compile={compile!r}: pass True, False, None (inductor on CUDA) or a backend name")
    return compile.lower()


def apply_compile(modules: list[nn.Module], backend: str, **options) -> None:
    """``block.compile(backend=backend, **options)`` for each decoder block of each of ``modules``
    (a transformers causal LM, a `StageModule`, a peft model; in place; the ``options`` are
    torch.compile's: mode, fullgraph, dynamic). A ValueError when a module holds no decoder block."""
    options = {k: v for k, v in options.items() if v is not None}
    blocks = [block for module in modules for block in _blocks(module)]
    for block in blocks:
        forward = block.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward):
            forward.compile(backend, **options)
        else:
            block.compile(backend=backend, **options)
    for module in modules:
        compile_loss(module.model if isinstance(module, StageModule) else module, backend)  # the loss's chunk kernels
        _train_without_cache(module)
    logger.info("torch.compile (%s%s) applied to %d decoder block(s)", backend,
                "".join(f", {k}={v}" for k, v in options.items()), len(blocks))


def _causal_lm(module: nn.Module) -> nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module  # peft: the causal LM


def _train_without_cache(module: nn.Module) -> None:
    """Make a training forward with gradients of ``module`` (a causal LM or its peft wrapper; a
    pipeline stage builds none) build no KV cache, as transformers' checkpointed layers do: a
    checkpointed layer's replay would append its keys and values to the cache a second time, and
    each layer's cache update takes its layer index, a constant that a graph shared by every block
    cannot hold (one recompile per layer). Idempotent."""
    if isinstance(module, StageModule):
        return
    model = _causal_lm(module)
    if not getattr(model, "_taco_trains_without_cache", False):
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
        model._taco_trains_without_cache = True


def _no_cache_in_training(module: nn.Module, args, kwargs):
    """``use_cache=False`` in a training forward with gradients (`_train_without_cache`)."""
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
        return args, {**kwargs, "use_cache": False}
    return None


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``module``; a ValueError when it holds none."""
    blocks = decoder_layers(module)
    if not blocks:
        raise ValueError(f"{type(module).__name__} holds no decoder block to compile; pass the causal LM or its "
                         "pipeline stages")
    return blocks


def has_decoder_layers(module: nn.Module) -> bool:
    """Whether ``module`` (a causal LM of a supported family, its peft wrapper, a `StageModule`)
    holds decoder layers: what `apply_compile` compiles and `enable_activation_checkpointing` wraps."""
    try:
        return bool(decoder_layers(module))
    except (ValueError, AttributeError):  # no registered family; a family's model without its layers
        return False


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: itself (``module.compile()``, a ``torch.compile`` wrapper,
    a compiled checkpointed forward) or, for a model or stage, each of its decoder blocks
    (`apply_compile`)."""
    return _itself_or_every_layer(module, _runs_compiled)


def _runs_compiled(module: nn.Module) -> bool:
    return (getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")
            or getattr(module.__dict__.get("forward"), "compiled", None) is not None)


def _itself_or_every_layer(module: nn.Module, holds) -> bool:
    """``holds(module)``, or for a model or stage: ``holds`` for each of its decoder layers (and it has some)."""
    if holds(module):
        return True
    try:
        layers = decoder_layers(module)
    except ValueError:
        return False
    return bool(layers) and all(holds(layer) for layer in layers)


class CheckpointedForward:
    """A decoder layer's ``forward`` (its class's) run under ``torch.utils.checkpoint``
    (non-reentrant) when the layer trains with gradients (the model then builds no KV cache:
    `_train_without_cache`); as it is otherwise
    (evaluation, ``no_grad``: nothing to replay). `compile` compiles the forward inside the
    checkpoint: the checkpoint stays out of the graph, so a side effect in a layer's forward
    (transformers' hub kernels set a context variable) is no graph break, and the replay runs the
    compiled code."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.compiled = None

    def __call__(self, *args, **kwargs):
        forward = self.compiled or functools.partial(type(self.layer).forward, self.layer)
        if self.layer.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    def compile(self, backend: str, **options) -> None:
        self.compiled = torch.compile(functools.partial(type(self.layer).forward, self.layer), backend=backend,
                                      **options)

    def __deepcopy__(self, memo):  # a copied layer checkpoints its own forward
        return CheckpointedForward(memo[id(self.layer)]) if id(self.layer) in memo else self


def enable_activation_checkpointing(module: nn.Module) -> None:
    """Recompute each decoder layer of ``module`` (a causal LM, a `StageModule`, a peft wrapper)
    in backward: its ``forward`` wrapped in ``torch.utils.checkpoint`` (see the module doc).
    Idempotent; a ValueError when ``module`` holds no decoder layer."""
    layers = decoder_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no decoder layer to checkpoint")
    todo = [layer for layer in layers if not is_checkpointed(layer)]
    for layer in todo:  # every layer checked before any is wrapped: no half-checkpointed model
        replaced = layer.__dict__.get("forward")
        if replaced is not None:  # wrapping the class's forward would drop it silently
            raise ValueError(f"{type(layer).__name__}.forward is replaced on the layer itself ({replaced!r}): activation "
                             "checkpointing wraps the class's forward; enable it before whatever replaced the forward "
                             "(e.g. Accelerate's device-map hooks), or remove that replacement")
    for layer in todo:
        layer.forward = CheckpointedForward(layer)
    _train_without_cache(module)
    logger.info("activation checkpointing: %d decoder layer(s) recompute their forward in backward", len(layers))


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` (a decoder layer; a model or stage: every one of its layers) recomputes
    its forward in backward (`enable_activation_checkpointing`)."""
    return _itself_or_every_layer(module, lambda layer: isinstance(layer.__dict__.get("forward"), CheckpointedForward))


__all__ = ["apply_compile", "compile_backend", "enable_activation_checkpointing", "has_decoder_layers", "is_checkpointed",
           "is_compiled"]
