"""TRL's private names that `taco_accel.taco_trainer` relies on.

- the forward that ``trl.trainer.utils.add_fused_lm_head`` installs: recognised by its keyword
  ``fused_lm_head``, found through the functools wrappers around it (``__wrapped__``); its settings
  (temperature, logit scale, the per-token figures asked for, ...) are the free variables of its
  closure (`fused_head_settings`), and what it returns is ``FusedCausalLMOutput``. taco_accel answers ``fused_lm_head=True`` in its own forward, vocab-parallel
  (`taco_accel.models.loss`), with those settings.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..errors import ConfigError
from .versions import check_range

SUPPORTED = ("1.16", "1.17")
FUSED_KEYWORD = "fused_lm_head"


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


def check_trainer(trainer_cls: type) -> None:
    """The installed TRL checked against `SUPPORTED` when ``trainer_cls`` is one of its trainers
    (or derives from one)."""
    if any(cls.__module__.split(".")[0] == "trl" for cls in trainer_cls.__mro__):
        check_version()
