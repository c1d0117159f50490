"""Sharded checkpoints of a pp x dp x tp run, and resume.

Layout of ``<dir>/step_<N>/``:

- ``model-pp{p}-tp{t}[-dp{d}].pt``: the state of this rank's pipeline stage(s) (``model`` keys
  are transformers keys; tensors are this rank's TP / FSDP shards) and of its optimizer. With
  DDP the dp replicas are identical and only dp rank 0 writes (no ``-dp`` suffix); with FSDP
  every dp rank writes its shard.
- ``rng-rank{r}.pt``: every rank's RNG states (torch, CUDA, Python, NumPy).
- ``meta.json``: step, mesh sizes, scheduler and data position, the metric history; written last
  by rank 0, so a folder without it is an incomplete checkpoint and is ignored.

Resuming needs the same mesh sizes (a resharding loader is future work). Loading restores
parameters, optimizer moments, scheduler, data position and RNG, so the resumed run repeats
the losses of an uninterrupted one bit for bit on the same machine.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def _to_local(obj):
    if hasattr(obj, "to_local"):  # DTensor (FSDP2 shard)
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _model_file(folder: Path, coords: dict, dp_mode: str) -> Path:
    suffix = f"-dp{coords['dp']}" if dp_mode == "fsdp" else ""
    return folder / f"model-pp{coords['pp']}-tp{coords['tp']}{suffix}.pt"


def save_checkpoint(folder: str | os.PathLike, *, stages, optimizer, coords: dict, dp_mode: str, meta: dict) -> Path:
    """Write this rank's shard of the checkpoint (a collective: call it on every rank)."""
    folder = Path(folder)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if dp_mode == "fsdp" or coords["dp"] == 0:
        state = {
            "model": [_to_local(s.state_dict()) for s in stages],
            "optimizer": _to_local(optimizer.state_dict()),
        }
        torch.save(state, _model_file(folder, coords, dp_mode))
    torch.save(_rng_state(), folder / f"rng-rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = folder / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / "meta.json")
        logger.info("saved checkpoint %s", folder)
    dist.barrier()
    return folder


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete ``step_<N>`` folder with the highest N under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name) and (p / "meta.json").exists()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def _copy_into_local(param: torch.Tensor, value: torch.Tensor) -> None:
    target = param.to_local() if hasattr(param, "to_local") else param
    if target.shape != value.shape:
        raise ValueError(f"checkpoint shard of shape {tuple(value.shape)} does not fit {tuple(target.shape)}; "
                         "resume with the mesh sizes the checkpoint was written with")
    with torch.no_grad():
        target.copy_(value)


def _rewrap_optimizer_state(optimizer) -> None:
    """After load_state_dict, turn local moments of DTensor (FSDP) parameters back into DTensors."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    optimizer.state[p][key] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements,
                                                                 shape=p.shape, stride=p.stride())


def load_checkpoint(folder: str | os.PathLike, *, stages, optimizer, coords: dict, dp_mode: str, dims: dict) -> dict:
    """Load this rank's shard into ``stages`` and ``optimizer``, restore RNG; return meta."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    if meta["dims"] != dims:
        raise ValueError(f"checkpoint {folder} was written with mesh {meta['dims']}, this run is {dims}; "
                         "resume with the same --pp/--dp/--tp")
    state = torch.load(_model_file(folder, coords, dp_mode), map_location="cpu", weights_only=False)
    for stage, saved in zip(stages, state["model"]):
        params = dict(stage.named_parameters())
        buffers = dict(stage.named_buffers())
        for name, value in saved.items():
            if name in params:
                _copy_into_local(params[name], value)
            elif name in buffers:
                _copy_into_local(buffers[name], value)
            else:
                raise ValueError(f"checkpoint key {name!r} is not in this stage; same model and mesh?")
    optimizer.load_state_dict(state["optimizer"])
    _rewrap_optimizer_state(optimizer)
    _set_rng_state(torch.load(folder / f"rng-rank{dist.get_rank()}.pt", weights_only=False))
    logger.info("resumed from %s (step %d)", folder, meta["step"])
    return meta
