"""Final export: gather a pp x dp x tp model (the modules of its `ModelParts`) into one transformers
checkpoint.

Each pipeline stage's (dp 0) ranks first gather their TP shards into full tensors (a collective
over tp), then the stages send their parts to global rank 0 (over the pp group), which loads them
into a fresh transformers model of the same config and calls ``save_pretrained``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _stage_state_dict(stage, mesh: DeviceMesh) -> dict:
    """Full (unsharded) tensors of one stage, HF keys; a collective over tp and dp."""
    model = stage.model
    if mesh["tp"].size() > 1:
        from ..models import gather_state_dict  # gathers FSDP shards over dp, then TP shards over tp

        state = gather_state_dict(model)
    else:
        state = model.state_dict()
    return {k: _full(v).detach().cpu() for k, v in state.items()}


def gather_full_state_dict(stages, mesh: DeviceMesh, drop: set[str] = frozenset()) -> dict | None:
    """The whole model's state dict on global rank 0 (None elsewhere). Call on every rank."""
    local: dict = {}
    for stage in stages:
        local.update(_stage_state_dict(stage, mesh))
    for key in drop:
        local.pop(key, None)
    if mesh["dp"].get_local_rank() != 0 or mesh["tp"].get_local_rank() != 0:
        return None
    pp_group = mesh["pp"].get_group()
    parts = [None] * mesh["pp"].size() if mesh["pp"].get_local_rank() == 0 else None
    dist.gather_object(local, parts, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    if parts is None:
        return None
    full: dict = {}
    for part in parts:
        full.update(part)
    return full


def export_pretrained(stages, mesh: DeviceMesh, config, path: str | os.PathLike, *, tokenizer=None,
                      drop: set[str] = frozenset()) -> None:
    """Write a transformers checkpoint (config, safetensors, tokenizer) of the trained model."""
    from transformers import AutoModelForCausalLM

    full = gather_full_state_dict(stages, mesh, drop)
    if full is None:
        dist.barrier()
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(full, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"export: missing keys {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info("exported the model to %s", path)
    dist.barrier()
