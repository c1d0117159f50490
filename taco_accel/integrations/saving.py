"""What a `taco_accel.Accelerator` saves and loads: its training state as taco_accel's
reshardable checkpoint (`Checkpoints`: ``save_state`` / ``load_state`` with Accelerate's
arguments, hooks and automatic naming), and a tensor-parallel model as a plain transformers
checkpoint (`full_state_dict`, `save_full_model`). Each is a collective: every rank calls it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from ..upstream import accelerate as upstream
from . import checkpoint as ckpt

logger = logging.getLogger(__name__)


class Checkpoints:
    """``save_state`` / ``load_state`` of an Accelerator (passed to each call), and the identity
    of its run, which its checkpoints keep (and which a resumed run takes over)."""

    def __init__(self):
        self.run: str | None = None  # made (a collective) at the first save, unless a load gave one

    def save(self, accelerator, output_dir: str | os.PathLike | None, safe_serialization: bool,
             unused: dict) -> Path:
        """Accelerate's ``save_state``: the hooks of ``register_save_state_pre_hook`` first
        (``hook(models, weights, output_dir)``; what they remove from ``weights`` is not saved),
        then every rank's shards into ``output_dir`` (automatic naming: the next
        ``checkpoints/checkpoint_<i>``); returns the folder. ``unused``: DeepSpeed's arguments
        in Accelerate (a warning names them)."""
        if not isinstance(safe_serialization, bool):
            raise TypeError(f"safe_serialization={safe_serialization!r}: pass True or False")
        if unused and accelerator.is_main_process:
            logger.warning("save_state ignores %s: Accelerate passes them to DeepSpeed's save_checkpoint, which "
                           "taco_accel does not use", sorted(unused))
        output_dir = self.folder(accelerator, output_dir)
        state = ckpt.TrainingState.of(accelerator)
        weights = [ckpt.model_weights(parts) for parts in state.parts]
        for hook in upstream.save_state_pre_hooks(accelerator):
            hook(accelerator.laid_out.models, weights, str(output_dir))
        folder = ckpt.save(output_dir, state, accelerator.torch_device_mesh, accelerator.parallel_dims,
                           run=self.run_identity(), weights=weights)
        accelerator.project_configuration.iteration += 1
        return folder

    def load(self, accelerator, input_dir: str | os.PathLike | None, options: dict) -> None:
        """Accelerate's ``load_state``: ``input_dir=None`` with automatic naming is the newest
        complete checkpoint; the hooks of ``register_load_state_pre_hook`` first (``hook(models,
        input_dir)``; models they remove are not loaded); ``options``: ``strict`` (default True)
        and ``map_location`` are taken, others are DeepSpeed's (a warning names them)."""
        mesh = accelerator.torch_device_mesh
        if input_dir is None:
            if not accelerator.project_configuration.automatic_checkpoint_naming:
                raise ValueError("load_state(None) needs ProjectConfiguration(automatic_checkpoint_naming=True); "
                                 "pass the checkpoint folder")
            input_dir = ckpt.latest(Path(accelerator.project_dir) / "checkpoints", mesh)
            if input_dir is None:
                raise ValueError(f"no complete checkpoint under {Path(accelerator.project_dir) / 'checkpoints'}")
        input_dir = Path(os.path.expanduser(input_dir))
        strict = options.pop("strict", True)
        unused = sorted(set(options) - {"map_location"})
        if unused and accelerator.is_main_process:
            logger.warning("load_state ignores %s: Accelerate passes them to DeepSpeed's load_checkpoint, which "
                           "taco_accel does not use", unused)
        models = accelerator.laid_out.models  # a hook removes those it restored itself
        for hook in upstream.load_state_pre_hooks(accelerator):
            hook(models, str(input_dir))
        keep = [i for i, model in enumerate(accelerator.laid_out.models) if any(model is m for m in models)]
        record = ckpt.load(input_dir, ckpt.TrainingState.of(accelerator), mesh, accelerator.parallel_dims,
                           models=keep, strict=strict)
        self.run = record.get("run") or self.run

    def run_identity(self) -> str:
        """This run's identity (made at the first call, a collective, unless a load gave one)."""
        if self.run is None:
            self.run = ckpt.new_run_identity()
        return self.run

    @staticmethod
    def folder(accelerator, output_dir) -> Path:
        """The folder a save writes: ``output_dir``, or with automatic checkpoint naming
        ``project_dir/checkpoints/checkpoint_<i>`` (the oldest pruned to keep ``total_limit``)."""
        config = accelerator.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError("save_state(None) needs ProjectConfiguration(automatic_checkpoint_naming=True); "
                                 "pass a folder")
            return Path(output_dir)
        root = Path(accelerator.project_dir) / "checkpoints"
        folder = root / f"checkpoint_{accelerator.save_iteration}"
        if accelerator.is_main_process and config.total_limit is not None:
            ckpt.prune(root, keep=config.total_limit - 1)
        return folder


def full_state_dict(model: nn.Module) -> dict | None:
    """The full (unsharded) state dict of a tensor-parallel ``model`` (unwrapped) with
    transformers' names, on every rank; None for a model taco_accel did not parallelise or
    emulates in one process (its own state dict is whole: Accelerate's applies)."""
    if getattr(model, "taco", None) is None or model.taco.emulated:
        return None
    from ..models import gather_state_dict

    return gather_state_dict(model)


def save_full_model(model: nn.Module, save_directory, max_shard_size) -> bool:
    """Write ``model`` (unwrapped, parallelised by taco_accel) as a plain transformers checkpoint
    (a peft model: its adapter, in peft's format at full shapes); False, writing nothing, for a
    model taco_accel did not parallelise (Accelerate's own save applies)."""
    if getattr(model, "taco", None) is None:
        return False
    if hasattr(model, "peft_config"):
        from .lora import save_adapter

        save_adapter(model, save_directory)
    else:
        from ..models import save_pretrained

        save_pretrained(model, save_directory, max_shard_size=max_shard_size)
    return True
