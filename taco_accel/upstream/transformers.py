"""transformers' private names that `taco_accel.taco_trainer` relies on.

- the ``Trainer`` methods a taco trainer overrides to save and restore sharded state
  (`TRAINER_METHODS`: name -> the parameters it is called with);
- the ``Accelerator`` name of ``transformers.trainer``, which ``create_accelerator_and_postprocess``
  calls to build the Trainer's accelerator (`building_accelerator` swaps it for that one call);
- which Trainer is building an accelerator (`trainer_building_accelerator`), so that a plain
  Trainer that builds `taco_accel.Accelerator` is refused;
- ``TrainingArguments._setup_devices`` (a cached property that sets Accelerate's process state
  up), computed again for CPU processes (`setup_devices_again`).
"""

from __future__ import annotations

import contextlib
import sys

from .versions import check_range

SUPPORTED = ("5.0", "5.26")
VERSION = check_range("transformers", *SUPPORTED)  # at import: every Accelerator and Trainer path needs it

TRAINER_METHODS = {
    "_save": ("self", "output_dir", "state_dict"),
    "_save_optimizer_and_scheduler": ("self", "output_dir"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_best_model": ("self",),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
}
BUILDER = "create_accelerator_and_postprocess"  # the Trainer method that builds its accelerator


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


def trainer_building_accelerator(depth: int = 8):
    """The transformers ``Trainer`` whose ``create_accelerator_and_postprocess`` is building an
    accelerator in the calling frames (within ``depth`` frames), or None."""
    if "transformers.trainer" not in sys.modules:
        return None
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == BUILDER and isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def check_trainer(trainer_cls: type) -> None:
    """A TypeError unless ``trainer_cls`` has every method of `TRAINER_METHODS` with those
    parameters (a transformers version that renamed one would silently skip our override)."""
    import inspect

    for name, params in TRAINER_METHODS.items():
        method = getattr(trainer_cls, name, None)
        found = tuple(inspect.signature(method).parameters) if callable(method) else None
        if found != params:
            shown = "missing" if found is None else "(" + ", ".join(found) + ")"
            raise TypeError(f"{trainer_cls.__name__}.{name} is {shown}, taco_trainer "
                            f"overrides it as ({', '.join(params)}): transformers {VERSION} is outside what taco_accel "
                            f"supports (>={SUPPORTED[0]},<{SUPPORTED[1]})")


def setup_devices_again(args) -> None:
    """Compute ``args._setup_devices`` again (it resets Accelerate's process state and builds it
    for the arguments as they are now)."""
    args.__dict__.pop("_setup_devices", None)  # a cached_property: computed again below
    args._setup_devices  # noqa: B018
