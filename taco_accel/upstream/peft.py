"""peft's private names that the tensor-parallel LoRA layers rely on.

- ``LoraConfig._register_custom_module``: LoRA layers for our parallel linear classes (peft's
  documented way to add custom modules, still private);
- ``LoraLayer._cast_input_dtype``: the cast of a layer's input to its adapter's dtype, as peft's
  own forward does;
- ``LoraLayer._get_in_out_features``: how a LoRA layer reads its base layer's sizes
  (`BaseLayerSizes` gives a parallel linear's full ones).
"""

from __future__ import annotations

from .versions import check_range

SUPPORTED = ("0.20", "0.23")  # from the lowest that passes tests/test_lora.py with transformers 5.10; 0.22 with 5.25


def check_version() -> str | None:
    """The installed peft version; a ConfigError outside `SUPPORTED` (checked at first use: peft is
    optional)."""
    return check_range("peft", *SUPPORTED)


def register_custom_modules(config, mapping: dict) -> None:
    """Make ``config`` (a ``LoraConfig``) put ``mapping[type(module)]`` layers on those modules."""
    check_version()
    config._register_custom_module(mapping)


class BaseLayerSizes:
    """Put in front of a peft LoRA layer class: its ``in_features`` / ``out_features`` are its base
    layer's own attributes (a parallel linear's full sizes, on which peft draws A and B), read
    without the guess (and its "Unsupported layer type" warning) that peft's
    ``_get_in_out_features`` (0.20-0.22) makes for a layer type it does not know."""

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features


def cast_input_dtype(layer, x, dtype):
    """``x`` in the dtype peft's LoRA ``layer`` computes its adapter in (peft's own cast)."""
    return layer._cast_input_dtype(x, dtype)
