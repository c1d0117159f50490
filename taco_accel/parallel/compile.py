"""torch.compile of a model laid out on the mesh (torchtitan's ``apply_compile``), and the switch.

`apply_compile` compiles every module of `ModelParts` in place (``nn.Module.compile``): the
object, its parameters, its state_dict keys and the hooks of the passes before it stay what they
were, so checkpoints, clipping and the pipeline schedule see the same module. Each module is
one region: the whole transformers model, or a whole pipeline stage (embedding, layers, norm,
head), so the small per-layer host costs (hooks, autograd nodes, the mask and rotary setup)
fuse into one graph. The TP collectives are custom ops (`comm.ops`): no graph break; their
codec decision and statistics run at run time inside the graph.

Activation checkpointing is transformers' own (``model.activation_checkpointing_enable()``, or
its older name ``gradient_checkpointing_enable()``): each decoder layer recomputes its forward
in backward, TP collectives included (a compressed forward recomputes the same bytes: the
codec is deterministic). It works on a parallelised model, in a pipeline stage, compiled or
not; enable it before `apply_compile` (`enable_activation_checkpointing` does it for a
`StageModule` or a peft model too).
"""

from __future__ import annotations

import logging

from torch import nn

from .stage import StageModule

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
    """``module.compile(backend=backend, **options)`` for each of ``modules`` (in place; the
    ``options`` are torch.compile's: mode, fullgraph, dynamic)."""
    options = {k: v for k, v in options.items() if v is not None}
    for module in modules:
        module.compile(backend=backend, **options)
    logger.info("torch.compile (%s%s) applied to %d module(s)", backend,
                "".join(f", {k}={v}" for k, v in options.items()), len(modules))


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled (``module.compile()`` or a ``torch.compile`` wrapper)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def enable_activation_checkpointing(module: nn.Module) -> None:
    """transformers' activation checkpointing (non-reentrant) on the causal LM inside ``module``
    (the model itself, a `StageModule`, or a peft wrapper)."""
    model = module.model if isinstance(module, StageModule) else module
    if hasattr(model, "get_base_model"):  # peft: its own enable also asks for input gradients
        model = model.get_base_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


__all__ = ["apply_compile", "compile_backend", "enable_activation_checkpointing", "is_compiled"]
