"""TRL's private names that `taco_accel.taco_trainer` relies on.

- ``_tp_size`` of TRL's trainers (SFT, DPO): the tensor-parallel size they divide their
  all-process token counts by; our gather spans the dp replicas only (each token once), so
  taco trainers set it to 1;
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
    """A TRL trainer divides its gathered token counts by nothing (they span the dp replicas)."""
    if hasattr(trainer, "_tp_size"):
        check_version()
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
