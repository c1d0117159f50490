"""Accelerate's private names that `taco_accel.Accelerator` and its checkpoints rely on.

- the lists an ``Accelerator`` keeps of what it prepared (``_optimizers``, ``_schedulers``,
  ``_dataloaders``) and registered (``_custom_objects``): our ``prepare_*`` append to them, as
  Accelerate's own do, and a checkpoint saves what they hold;
- the ``_is_accelerate_prepared`` mark on what ``prepare`` returned;
- the hooks of ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
  (``_save_model_state_pre_hook``, ``_load_model_state_pre_hook``), which our ``save_state`` /
  ``load_state`` run as Accelerate's do.
"""

from __future__ import annotations

from .versions import check_range

SUPPORTED = ("1.15", "1.17")
VERSION = check_range("accelerate", *SUPPORTED)  # at import: every Accelerator and Trainer path needs it

PREPARED = {"optimizer": "_optimizers", "scheduler": "_schedulers", "dataloader": "_dataloaders",
            "custom": "_custom_objects"}


def prepared(accelerator, kind: str) -> list:
    """The accelerator's own list of prepared objects of ``kind`` (see `PREPARED`)."""
    return getattr(accelerator, PREPARED[kind])


def add_prepared(accelerator, kind: str, obj) -> None:
    """Keep ``obj`` in the accelerator's list of ``kind``, as Accelerate's ``prepare_*`` do."""
    prepared(accelerator, kind).append(obj)


def is_prepared(obj) -> bool:
    """Whether ``obj`` came out of an Accelerator's ``prepare`` (Accelerate's mark)."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def save_state_pre_hooks(accelerator) -> list:
    """The hooks ``register_save_state_pre_hook`` registered, in order."""
    return list(accelerator._save_model_state_pre_hook.values())


def load_state_pre_hooks(accelerator) -> list:
    """The hooks ``register_load_state_pre_hook`` registered, in order."""
    return list(accelerator._load_model_state_pre_hook.values())
