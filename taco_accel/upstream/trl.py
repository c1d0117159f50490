"""TRL's private names that `taco_accel.taco_trainer` relies on.

- TRL's online trainers (GRPO, RLOO): ``generation_batch_size``, which their configs derive from
  every process (`generate_per_replica`), and the module-level ``gather`` / ``gather_object``
  (Accelerate's, over every process) with which their private ``_generate_and_score_completions``
  gathers rewards and logs before slicing by ``accelerator.process_index`` (`online_trainer`,
  `gathering_with`);
- the forward that ``trl.trainer.utils.add_fused_lm_head`` installs: recognised by its keyword
  ``fused_lm_head``, found through the functools wrappers around it (``__wrapped__``); its settings
  (temperature, logit scale, the per-token figures asked for, ...) are the free variables of its
  closure (`fused_head_settings`), and what it returns is ``FusedCausalLMOutput``. taco_accel answers ``fused_lm_head=True`` in its own forward, vocab-parallel
  (`taco_accel.models.loss`), with those settings.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

from ..errors import ConfigError
from .versions import check_range

SUPPORTED = ("1.16", "1.17")
FUSED_KEYWORD = "fused_lm_head"

logger = logging.getLogger(__name__)


def check_version() -> str | None:
    """The installed trl version; a ConfigError outside `SUPPORTED` (checked at first use: trl is
    optional)."""
    return check_range("trl", *SUPPORTED)


@dataclass(frozen=True)
class FusedHeadSettings:
    """What ``add_fused_lm_head`` was called with, the forward it replaced (``original_forward``) and
    the class its forward returns (``output_type``: ``FusedCausalLMOutput``)."""

    temperature: float
    logit_scale: float
    final_logit_softcapping: float | None
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    original_forward: object
    output_type: type


SETTINGS = ("temperature", "logit_scale", "final_logit_softcapping", "cast_lm_head_to_fp32", "outputs",
            "original_forward")


def fused_forward(forward):
    """The function ``add_fused_lm_head`` installed, if ``forward`` is it or wraps it (Accelerate's
    ``convert_outputs_to_fp32`` and autocast wrap with ``functools.wraps``); else None. The walk stops
    at the fused forward: it wraps the model class's own ``forward`` in turn."""
    if forward is None:
        return None
    found = inspect.unwrap(forward, stop=_takes_fused_keyword)
    return found if _takes_fused_keyword(found) else None


def has_fused_head(forward) -> bool:
    """Whether ``forward`` is the one ``add_fused_lm_head`` installed (it takes ``fused_lm_head``), or wraps it."""
    return fused_forward(forward) is not None


def _takes_fused_keyword(function) -> bool:
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is not None and FUSED_KEYWORD in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def fused_head_settings(forward) -> FusedHeadSettings | None:
    """The settings of TRL's fused forward ``forward`` (None when it is not one; a ConfigError when
    TRL's forward no longer closes over the names `SETTINGS` lists)."""
    found = fused_forward(forward)
    if found is None:
        return None
    function = getattr(found, "__func__", found)
    names = inspect.getclosurevars(function).nonlocals
    missing = [name for name in SETTINGS if name not in names]
    if missing:
        raise ConfigError(f"TRL's fused LM head forward no longer holds {missing}; taco_accel reads its settings from "
                          f"trl {SUPPORTED[0]} up to {SUPPORTED[1]}: install a trl version in that range")
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedHeadSettings(**{name: names[name] for name in SETTINGS}, output_type=FusedCausalLMOutput)


# TRL's trainers that train against one process at tp=2 in tests/test_hf_trainer.py (and the entry
# matrix); taco_trainer refuses TRL's others at construction
CHECKED_TRAINERS = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer")


def check_trainer(trainer_cls: type) -> None:
    """When ``trainer_cls`` is one of TRL's trainers (or derives from one): the installed TRL
    checked against `SUPPORTED`, and a ValueError unless its closest TRL class is one of
    `CHECKED_TRAINERS` from ``trl`` itself (``trl.experimental``'s ORPO, online DPO, GKD, ... and
    the Distillation and Reward trainers keep batch arithmetic, teacher models or generation of
    their own that no test checks under tensor parallelism)."""
    trl_class = next((cls for cls in trainer_cls.__mro__ if cls.__module__.split(".")[0] == "trl"), None)
    if trl_class is None:
        return
    check_version()
    if trl_class.__name__ in CHECKED_TRAINERS and not trl_class.__module__.startswith("trl.experimental"):
        return
    raise ValueError(f"{trl_class.__module__}.{trl_class.__name__} is not checked with taco_accel (its batch "
                     f"arithmetic, reference or teacher model and generation under tensor parallelism): taco_trainer "
                     f"takes trl's {', '.join(CHECKED_TRAINERS)}; train {trl_class.__name__} without taco_trainer (the "
                     "plain class, no tensor parallelism)")


ONLINE_TRAINERS = ("GRPOTrainer", "RLOOTrainer")  # TRL's trainers that generate their completions
MODULE_GATHERS = ("gather", "gather_object")  # Accelerate's world collectives their modules import
SCORING = ("_generate_and_score_completions", ("self", "inputs"))  # the method that gathers with them


def online_trainer(trainer_cls: type) -> type | None:
    """The TRL class among `ONLINE_TRAINERS` that ``trainer_cls`` is or derives from (None for the
    others); a TypeError where its module or its scoring method (`SCORING`) is not as relied on."""
    found = next((cls for cls in trainer_cls.__mro__
                  if cls.__name__ in ONLINE_TRAINERS and cls.__module__.split(".")[0] == "trl"), None)
    if found is None:
        return None
    import sys

    module, (name, params) = sys.modules[found.__module__], SCORING
    missing = [n for n in MODULE_GATHERS if not callable(getattr(module, n, None))]
    signature = tuple(inspect.signature(getattr(found, name)).parameters)
    if missing or signature != params:
        raise TypeError(f"{found.__name__}: taco_trainer relies on {found.__module__}'s {', '.join(MODULE_GATHERS)} and "
                        f"{name}({', '.join(params)}), found missing {missing} and ({', '.join(signature)}): install "
                        f"trl>={SUPPORTED[0]},<{SUPPORTED[1]}")
    return found


@contextlib.contextmanager
def gathering_with(online_cls: type, gather, gather_object):
    """Inside, the module of ``online_cls`` (a class `online_trainer` returned) gathers with
    ``gather`` and ``gather_object`` instead of Accelerate's world collectives.

    TRL gathers the rewards (and RLOO its KL terms) and the logged prompts and completions over
    every process, then keeps this process's rows by ``accelerator.process_index``; under tensor
    parallelism the tp ranks of a replica hold the same rows and ``process_index`` is the replica,
    so the gathers must run over the replicas: each row once, in replica order (one process's
    group and batch statistics, and this replica's slice)."""
    import sys

    module = sys.modules[online_cls.__module__]
    before = {name: getattr(module, name) for name in MODULE_GATHERS}
    module.gather, module.gather_object = gather, gather_object
    try:
        yield
    finally:
        for name, function in before.items():
            setattr(module, name, function)


def generate_per_replica(args, replicas: int) -> None:
    """Make ``args.generation_batch_size`` (GRPOConfig, RLOOConfig) what the data-parallel replicas
    generate: ``per_device_train_batch_size x replicas x steps_per_generation``; a ValueError where
    that holds no whole groups of ``num_generations``.

    TRL derives it with ``args.world_size``, every process, while the tp ranks of a replica read one
    batch: its RepeatSampler then cuts the prompt stream into chunks tp times what one generation
    reads, repeated ``steps_per_generation x num_iterations`` times, and with either above 1 a replica
    trains some prompts twice and skips others (one process trains each chunk once). Re-derived from
    ``steps_per_generation``, which TRL's defaults derive from (``gradient_accumulation_steps``); a
    ``generation_batch_size`` set by hand came out of TRL divided by the processes, not the replicas,
    so a changed value is logged (a warning where steps_per_generation is not TRL's default)."""
    if getattr(args, "generation_batch_size", None) is None or getattr(args, "steps_per_generation", None) is None:
        return
    derived = args.per_device_train_batch_size * replicas * args.steps_per_generation
    if derived % args.num_generations:
        raise ValueError(f"generation_batch_size: per_device_train_batch_size {args.per_device_train_batch_size} x "
                         f"{replicas} data-parallel replicas x steps_per_generation {args.steps_per_generation} = "
                         f"{derived} completions a generation, not whole groups of num_generations={args.num_generations} "
                         "(the tp ranks of a replica share its prompts): raise per_device_train_batch_size or "
                         "steps_per_generation to a multiple")
    if derived == args.generation_batch_size:
        return
    log = logger.info if args.steps_per_generation == args.gradient_accumulation_steps else logger.warning
    if args.process_index == 0:
        log("generation_batch_size %d -> %d: %d per device x %d data-parallel replicas x steps_per_generation %d "
            "(TRL counted every process, whose tp ranks share the replica's prompts); to generate more at a time, set "
            "steps_per_generation", args.generation_batch_size, derived, args.per_device_train_batch_size, replicas,
            args.steps_per_generation)
    args.generation_batch_size = derived


def refuse_weight_copies(args, tp: int) -> None:
    """A ValueError at tp > 1 for the generation back ends of TRL's online trainers that hold a copy
    of the weights of their own (vLLM, transformers' continuous batching), which TRL fills from the
    model's state dict: under tensor parallelism, this rank's shards."""
    if tp == 1:
        return
    for name in ("use_vllm", "use_transformers_continuous_batching"):  # use_transformers_paged sets the latter
        if getattr(args, name, False):
            raise ValueError(f"{name}=True at tp={tp}: that generation back end holds its own copy of the weights, and "
                             "a tensor-parallel model has only this rank's shards to give it; leave it off (TRL then "
                             "generates with the tensor-parallel model itself)")
