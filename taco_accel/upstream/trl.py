"""TRL's private names that `taco_accel.taco_trainer` relies on, and its token count under TP.

- ``_tp_size`` of TRL's trainers (SFT, DPO): they set it to ``parallelism_config.tp_size`` and
  divide their ``gather_for_metrics`` token counts by it, counting each tp rank's copy of a batch
  once. taco_accel's ``gather_for_metrics`` gives each sample once already (the Trainer's
  evaluation needs that: it cuts the padding of the last uneven batch by Accelerate's remainder,
  which rows repeated per tp rank would misplace), so taco trainers set it to 1
  (`count_tokens_once`);
- the keyword ``fused_lm_head`` of the forward that ``trl.trainer.utils.add_fused_lm_head``
  installs (how a fused head is recognised: `has_fused_head`), found through the functools
  wrappers around it (``__wrapped__``: Accelerate's ``convert_outputs_to_fp32`` and autocast on a
  prepared model, TRL's own ``functools.wraps``).
"""

from __future__ import annotations

import inspect

from .versions import check_range

SUPPORTED = ("1.16", "1.17")
FUSED_KEYWORD = "fused_lm_head"


def check_version() -> str | None:
    """The installed trl version; a ConfigError outside `SUPPORTED` (checked at first use: trl is
    optional)."""
    return check_range("trl", *SUPPORTED)


def count_tokens_once(trainer) -> None:
    """A TRL trainer divides its ``gather_for_metrics`` token counts by nothing (each sample is
    gathered once)."""
    if hasattr(trainer, "_tp_size"):
        trainer._tp_size = 1


def has_fused_head(forward) -> bool:
    """Whether ``forward`` is the one ``add_fused_lm_head`` installed (it takes ``fused_lm_head``), or
    wraps it: a model that Accelerate prepared under mixed precision has ``convert_outputs_to_fp32``
    around autocast around it, each a ``functools.wraps`` (``__wrapped__``). The walk stops at the
    fused forward: it wraps the model class's own ``forward`` in turn."""
    if forward is None:
        return False
    return _takes_fused_keyword(inspect.unwrap(forward, stop=_takes_fused_keyword))


def _takes_fused_keyword(function) -> bool:
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is not None and FUSED_KEYWORD in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def check_trainer(trainer_cls: type) -> None:
    """The installed TRL checked against `SUPPORTED` when ``trainer_cls`` is one of its trainers
    (or derives from one)."""
    if any(cls.__module__.split(".")[0] == "trl" for cls in trainer_cls.__mro__):
        check_version()
