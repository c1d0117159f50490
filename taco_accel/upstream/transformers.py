"""transformers' private names that taco_accel relies on, and its Trainer's counts under TP.

- the ``Trainer`` methods a taco trainer overrides to save and restore sharded state and to give
  its total batch size (`TRAINER_METHODS`: name -> the parameters it is called with); ``save_model``
  among them, with its private ``_internal_call``: before 5.23 it calls ``_save`` on the main
  process only, and gathering a sharded model takes every process;
- the ``Accelerator`` name of ``transformers.trainer``, which ``create_accelerator_and_postprocess``
  calls to build the Trainer's accelerator (`building_accelerator` swaps it for that one call;
  `trainer_builds_with` reads it);
- ``TrainingArguments._setup_devices`` (a cached property that sets Accelerate's process state
  up), computed again for CPU processes (`setup_devices_again`);
- ``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``, whose cache
  parameter was renamed (``past_key_values`` -> ``cache`` in 5.24): `mask_builders`;
- a model's ``loss_function``: its setter keeps the function in the private ``_loss_function``, the
  getter falls back to transformers' default, ``LOSS_MAPPING["ForCausalLM"]`` for a causal LM
  (`default_causal_lm_loss`); `own_loss_function` reads one a user set (5.10-5.25);
- a causal LM's forward: the output class its ``forward`` returns (`causal_lm_output_type`, from the
  annotation) and the slice ``logits_to_keep`` takes of the hidden states (`logits_slicer`:
  transformers' own function where it has one, which also takes a 2-D mask or positions; 5.10's
  slicing by an int or 1-D positions otherwise);
- ``_hf_peft_config_loaded``, which ``PeftAdapterMixin.add_adapter`` / ``load_adapter`` set on a
  model that holds peft adapters (`has_peft_adapters`; 5.10-5.25);
- `TrainerCounts`: the one count of the Trainer (its total train batch size) that its
  accelerator's replica counts do not give.

``SUPPORTED`` starts at 5.10, the oldest transformers the suite runs (scripts/stacks/oldest.txt).
"""

from __future__ import annotations

import contextlib
import inspect

from .versions import check_range

SUPPORTED = ("5.10", "5.26")

TRAINER_METHODS = {
    "save_model": ("self", "output_dir", "_internal_call"),  # before 5.23 it calls _save on the main process only
    "_save": ("self", "output_dir", "state_dict"),
    "_save_optimizer_and_scheduler": ("self", "output_dir"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_best_model": ("self",),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "get_total_train_batch_size": ("self", "args"),
}
BUILDER = "create_accelerator_and_postprocess"  # the Trainer method that builds its accelerator


def check_version() -> str | None:
    """The installed transformers version; a ConfigError outside `SUPPORTED`."""
    return check_range("transformers", *SUPPORTED)


def check_model(model) -> None:
    """The installed transformers checked against `SUPPORTED` when ``model`` is one of its models
    (`parallelize` rewrites their modules, masks and loss)."""
    if type(model).__module__.split(".")[0] == "transformers":
        check_version()


@contextlib.contextmanager
def building_accelerator(factory):
    """Inside, ``transformers.trainer.Accelerator`` is ``factory`` (what a Trainer's
    ``create_accelerator_and_postprocess`` builds its accelerator with)."""
    import transformers.trainer as trainer_module

    built = trainer_module.Accelerator
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = built


def trainer_builds_with():
    """What a Trainer's ``create_accelerator_and_postprocess`` would build its accelerator with
    now (``transformers.trainer.Accelerator``); None while transformers' Trainer is not imported."""
    import sys

    module = sys.modules.get("transformers.trainer")
    return None if module is None else getattr(module, "Accelerator", None)


def check_trainer(trainer_cls: type) -> None:
    """A TypeError unless ``trainer_cls`` has every method of `TRAINER_METHODS` with those
    parameters (a transformers version that renamed one would silently skip our override)."""
    for name, params in TRAINER_METHODS.items():
        method = getattr(trainer_cls, name, None)
        found = tuple(inspect.signature(method).parameters) if callable(method) else None
        if found != params:
            shown = "missing" if found is None else "(" + ", ".join(found) + ")"
            raise TypeError(f"{trainer_cls.__name__}.{name} is {shown}, taco_trainer overrides it as "
                            f"({', '.join(params)}): install transformers>={SUPPORTED[0]},<{SUPPORTED[1]}")


def setup_devices_again(args) -> None:
    """Compute ``args._setup_devices`` again (it resets Accelerate's process state and builds it
    for the arguments as they are now)."""
    args.__dict__.pop("_setup_devices", None)  # a cached_property: computed again below
    args._setup_devices  # noqa: B018


def default_causal_lm_loss():
    """transformers' default causal-LM loss, ``LOSS_MAPPING["ForCausalLM"]`` (what a model's
    ``loss_function`` returns when none was set on it). Resolved outside any forward: torch.compile
    does not trace an import through transformers' lazy modules (a graph break)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def own_loss_function(model, default):
    """The ``loss_function`` set on ``model`` (the setter's private ``_loss_function``) unless it is
    ``default`` (`default_causal_lm_loss`); None otherwise. Read without the getter, which warns (a
    graph break under torch.compile) where the config names no ``loss_type``."""
    function = getattr(model, "_loss_function", None)  # a module set as the loss lives in _modules
    return None if function is None or function is default else function


def causal_lm_output_type(model_class: type) -> type:
    """The ``ModelOutput`` class ``model_class.forward`` returns (its return annotation); a
    TypeError naming the class when the annotation is not one."""
    import sys

    from transformers.utils import ModelOutput

    forward = model_class.forward
    annotation = inspect.signature(forward).return_annotation
    if isinstance(annotation, str):  # postponed annotations: the name in the forward's module
        raw = inspect.unwrap(forward)
        annotation = getattr(sys.modules.get(raw.__module__), annotation, None)
    fields = getattr(annotation, "__dataclass_fields__", {})
    if not (isinstance(annotation, type) and issubclass(annotation, ModelOutput) and {"loss", "logits"} <= set(fields)):
        raise TypeError(f"{model_class.__name__}.forward is annotated {annotation!r}, not a ModelOutput with loss and "
                        "logits: taco_accel returns the output class a causal LM's forward declares")
    return annotation


def logits_slicer():
    """``slice(hidden, logits_to_keep)``: the hidden states (b, s, h) the lm head multiplies for
    ``logits_to_keep`` (0: all), as the installed transformers' causal LMs slice them. Resolved
    outside any forward (an import inside one is a graph break)."""
    from transformers import modeling_utils

    upstream = getattr(modeling_utils, "slice_logits_to_keep", None)  # not in 5.10
    return upstream if upstream is not None else _slice_logits_to_keep


def _slice_logits_to_keep(hidden, logits_to_keep):
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


def has_peft_adapters(model) -> bool:
    """Whether transformers' ``add_adapter`` / ``load_adapter`` put peft adapters on ``model``
    (its private ``_hf_peft_config_loaded``, 5.10-5.25)."""
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def mask_builders() -> dict:
    """transformers' attention-mask builders by the layer type they serve (``"full_attention"``,
    ``"sliding_attention"``), each called as ``build(config, inputs_embeds, position_ids)`` for a
    batch without a padding mask or KV cache (``position_ids`` marking where packed sequences
    restart). Resolved once, outside any forward: torch.compile traces neither the import of a
    transformers submodule through its lazy module (a graph break, "Bad import result") nor the
    signature read that names the cache parameter."""
    from transformers import masking_utils

    builders = {"full_attention": masking_utils.create_causal_mask,
                "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    return {layer_type: _without_cache(build) for layer_type, build in builders.items()}


def _without_cache(build):
    cache = "cache" if "cache" in inspect.signature(build).parameters else "past_key_values"  # renamed in 5.24

    def mask(config, inputs_embeds, position_ids):
        return build(config=config, inputs_embeds=inputs_embeds, attention_mask=None, position_ids=position_ids,
                     **{cache: None})  # no default in either version

    return mask


class TrainerCounts:
    """The Trainer's one count that its accelerator's counts do not give, put in front of a
    Trainer class.

    The taco trainer's accelerator counts the data-parallel replicas (``num_processes``,
    ``gather``) and describes them as its ``parallelism_config`` (tp 1), so that transformers
    5.10-5.25 computes the rest right by itself: its loss scale (``num_processes //`` the tp size,
    5.10 reading the config, 5.25 ``get_tp_size()``, which falls back to it), the token count it
    gathers over the replicas and divides by the processes sharing a batch (1; an ungathered one,
    ``average_tokens_across_devices=False``, too), ``num_input_tokens_seen``; TRL's loss scale and
    token counts alike (its ``_tp_size`` is the config's). Its total train batch size (the log
    line, ``train_samples_per_second``) divides ``args.world_size``, every process, instead: here
    it counts the replicas (`get_total_train_batch_size`).
    """

    def get_total_train_batch_size(self, args) -> int:
        """The global batch of one optimizer step: per-device batch x accumulation x the
        accelerator's data-parallel replicas."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
