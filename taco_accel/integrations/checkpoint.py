"""Sharded training checkpoints of a pp x dp x tp run: atomic, checksummed, read without pickle code.

The one checkpoint format of taco_accel (`Accelerator.save_state` / ``load_state``; the
recipes' ``--save-every`` / ``--resume``). A checkpoint is a folder:

- ``model-pp{p}-tp{t}[-dp{d}].pt``: ``{"models": [[state dict per module] per model],
  "optimizers": [state dict per optimizer]}`` of one mesh coordinate; transformers keys,
  this rank's TP (and FSDP) shards. DDP replicas are identical, so only dp rank 0 writes (no
  ``-dp`` suffix); under FSDP every dp rank writes its shard.
- ``rank{r}.pt``: rank r's random states (torch, CUDA, Python, NumPy).
- ``state.pt`` (rank 0): schedulers, the gradient scaler, DataLoader positions, the
  accelerator's step counter and the objects registered with ``register_for_checkpointing``.
- ``meta.json``, written last: format version, mesh sizes, and every file's size and sha256.

**Atomic**: every rank writes into a hidden sibling ``.<name>.tmp-<token>``; once all ranks
have reported their files' checksums, rank 0 writes ``meta.json`` there and renames the folder
into place (an existing folder of that name is renamed aside first and deleted after). A job
killed at any moment leaves the previous complete folder, or no folder of that name: never
one rank's new shard next to another's old one. **Safe**: files are read with
``torch.load(weights_only=True)`` (a planted file cannot run code), after their size and
checksum are checked; a problem names the file, on every rank at once (one exchange), so no
rank is left waiting in a collective. `latest` skips damaged checkpoints with a warning.

Resuming needs the same mesh sizes; it restores parameters, optimizer moments, schedulers,
RNG states and data positions, so a resumed run repeats the losses of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..parallel import ModelParts, ParallelDims

logger = logging.getLogger(__name__)

FORMAT = "taco_accel-checkpoint"
VERSION = 1
META = "meta.json"
SHARED = "state.pt"
NAME = re.compile(r"(?:step|checkpoint)_(?P<step>\d+)")
HIDDEN = re.compile(r"\.(?:step|checkpoint)_(?P<step>\d+)\.(?P<kind>tmp|old)-[0-9a-f]+")


@dataclass
class TrainingState:
    """What a checkpoint holds: the laid-out models, their optimizers and schedulers, the
    gradient scaler, the prepared DataLoaders, registered objects and the step counter."""

    parts: list[ModelParts]
    optimizers: list
    schedulers: list
    dataloaders: list
    custom: list
    scaler: object = None
    owner: object = None  # the accelerator: its ``step`` is saved and restored

    @classmethod
    def of(cls, accelerator) -> "TrainingState":
        return cls([parts for _, parts in accelerator._parts], accelerator._optimizers, accelerator._schedulers,
                   accelerator._dataloaders, accelerator._custom_objects, accelerator.scaler, accelerator)


# -- saving -------------------------------------------------------------------------------------
def save(folder: str | os.PathLike, state: TrainingState, mesh, dims: ParallelDims) -> Path:
    """Write ``state`` into ``folder`` atomically (a collective over every rank)."""
    coords = {name: mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}
    files = {}
    if dims.dp_mode == "fsdp" or coords["dp"] == 0:
        files[model_file(coords, dims)] = {
            "models": [[_local(m.state_dict()) for m in parts.modules] for parts in state.parts],
            "optimizers": [_local(opt.state_dict()) for opt in state.optimizers],
        }
    files[f"rank{_rank()}.pt"] = _rng_state()
    if _rank() == 0:
        files[SHARED] = {
            "schedulers": [s.state_dict() for s in state.schedulers],
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "dataloaders": [_loader_state(dl) for dl in state.dataloaders],
            "custom": [obj.state_dict() for obj in state.custom],
            "step": getattr(state.owner, "step", 0),
        }
    meta = {"format": FORMAT, "version": VERSION, "dims": dataclasses.asdict(dims)}
    return write(folder, files, meta)


def write(folder: str | os.PathLike, files: dict[str, object], meta: dict) -> Path:
    """Each rank saves its ``files`` (name -> object); rank 0 adds ``meta`` with every file's
    size and checksum and commits the folder (see the module doc). A collective."""
    folder = Path(folder)
    token = _broadcast(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    tmp = folder.parent / f".{folder.name}.tmp-{token}"
    if _rank() == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        for stale in folder.parent.glob(f".{folder.name}.*-*"):  # leftovers of killed saves
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    mine = {name: _save_hashed(obj, tmp / name) for name, obj in files.items()}
    reports = _all_gather(mine)
    if _rank() == 0:
        meta = {**meta, "files": {k: v for report in reports for k, v in report.items()}}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        aside = folder.parent / f".{folder.name}.old-{token}"
        if folder.exists():
            os.rename(folder, aside)
        os.rename(tmp, folder)
        _fsync_dir(folder.parent)
        shutil.rmtree(aside, ignore_errors=True)
        logger.info("saved checkpoint %s", folder)
    _barrier()
    return folder


def model_file(coords: dict, dims: ParallelDims) -> str:
    suffix = f"-dp{coords['dp']}" if dims.dp_mode == "fsdp" else ""
    return f"model-pp{coords['pp']}-tp{coords['tp']}{suffix}.pt"


# -- loading ------------------------------------------------------------------------------------
def load(folder: str | os.PathLike, state: TrainingState, mesh, dims: ParallelDims) -> dict:
    """Restore ``state`` from ``folder`` (a collective); return its meta."""
    folder = Path(folder)
    meta = _agree(lambda: _meta(folder, dims), f"checkpoint {folder}")
    coords = {name: mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}
    names = [model_file({**coords, "dp": coords["dp"] if dims.dp_mode == "fsdp" else 0}, dims),
             f"rank{_rank()}.pt", SHARED]
    loaded = _agree(lambda: {n: read(folder, n, meta) for n in names}, f"checkpoint {folder}")
    model_state = loaded[names[0]]
    if len(model_state["models"]) != len(state.parts) or len(model_state["optimizers"]) != len(state.optimizers):
        raise CheckpointError(
            f"{folder} holds {len(model_state['models'])} model(s) and {len(model_state['optimizers'])} optimizer(s); "
            f"this run prepared {len(state.parts)} and {len(state.optimizers)}: prepare the same objects before load_state"
        )
    for parts, saved in zip(state.parts, model_state["models"]):
        for module, values in zip(parts.modules, saved):
            _copy_into(module, values, folder)
    for opt, saved in zip(state.optimizers, model_state["optimizers"]):
        opt.load_state_dict(saved)
        _rewrap_optimizer_state(opt.optimizer if hasattr(opt, "optimizer") else opt)
    shared = loaded[SHARED]
    for sched, saved in zip(state.schedulers, shared["schedulers"]):
        sched.load_state_dict(saved)
    if state.scaler is not None and shared["scaler"] is not None:
        state.scaler.load_state_dict(shared["scaler"])
    for dl, saved in zip(state.dataloaders, shared["dataloaders"]):
        _set_loader_state(dl, saved)
    if len(shared["custom"]) != len(state.custom):
        raise CheckpointError(f"{folder} holds {len(shared['custom'])} registered object(s), this run registered "
                              f"{len(state.custom)}: register the same objects (register_for_checkpointing)")
    for obj, saved in zip(state.custom, shared["custom"]):
        obj.load_state_dict(saved)
    if state.owner is not None:
        state.owner.step = shared["step"]
    _set_rng_state(loaded[f"rank{_rank()}.pt"])
    logger.info("resumed from %s", folder)
    return meta


def read(folder: Path, name: str, meta: dict):
    """One file of a checkpoint, checked against ``meta`` first, loaded without running code."""
    path = folder / name
    problem = _check(path, meta["files"].get(name))
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickling refusal: not a file this code wrote
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True) ({e}); a taco_accel checkpoint "
                              "holds tensors, numbers, strings and containers only") from e


def latest(root: str | os.PathLike, mesh=None) -> Path | None:
    """The newest complete, undamaged checkpoint folder (``step_<N>`` / ``checkpoint_<N>``)
    under ``root``, or None when there is none. Damaged ones are skipped with a warning that
    names their files; if every one is damaged, a `CheckpointError`. A save killed between its
    two renames leaves its complete new folder hidden (``.step_<N>.tmp-*``, with meta.json):
    it counts, before the old one it replaces. A collective: each rank checks a share of the
    files (it also works without torch.distributed, for a look at a run's folder)."""
    root = Path(root)
    found = _broadcast(_candidates(root) if _rank() == 0 else None)
    damaged = []
    for folder in found:
        meta = json.loads((folder / META).read_text())
        names = sorted(meta.get("files", {}))
        mine = [f"{n}: {p}" for n in names[_rank()::_world()] if (p := _check(folder / n, meta["files"][n]))]
        problems = [p for part in _all_gather(mine) for p in part]
        if not problems:
            return folder
        damaged.append(folder)
        if _rank() == 0:
            logger.warning("checkpoint %s is damaged (%s); trying the one before", folder, "; ".join(problems))
    if damaged:
        raise CheckpointError(f"every checkpoint under {root} is damaged ({', '.join(map(str, damaged))}); "
                              "start without --resume or restore them from a copy")
    return None


def prune(root: Path, keep: int) -> None:
    """Delete the oldest complete checkpoints under ``root`` so that at most ``keep`` remain."""
    for folder in _candidates(root)[max(keep, 0):]:
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("deleted checkpoint %s (total_limit)", folder)


def step_of(folder: Path) -> int:
    match = NAME.fullmatch(Path(folder).name) or HIDDEN.fullmatch(Path(folder).name)
    return int(match.group("step")) if match else -1


# -- helpers ------------------------------------------------------------------------------------
def _candidates(root: Path) -> list[Path]:
    """Complete checkpoint folders (with a meta.json), newest step first; for one step, the
    visible folder, then a committed-but-not-renamed one, then the one it was replacing."""
    if not root.is_dir():
        return []
    rank = {"": 0, "tmp": 1, "old": 2}
    done = []
    for p in root.iterdir():
        match = HIDDEN.fullmatch(p.name) or NAME.fullmatch(p.name)
        if not match:
            continue
        kind = match.groupdict().get("kind") or ""
        if (p / META).exists():
            done.append((-int(match.group("step")), rank[kind], p))
        elif not kind:
            logger.warning("ignoring %s: no %s (not written by this version, or not a checkpoint)", p, META)
    return [p for *_, p in sorted(done)]


def _meta(folder: Path, dims: ParallelDims) -> dict:
    path = folder / META
    if not path.exists():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {META})")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, this code "
                              f"reads {FORMAT!r} version {VERSION}")
    if meta["dims"] != dataclasses.asdict(dims):
        raise CheckpointError(f"{folder} was written with mesh {meta['dims']}, this run is {dataclasses.asdict(dims)}: "
                              "resume with the same pp / dp / tp sizes and dp mode")
    return meta


def _agree(fn, what: str):
    """``fn()`` on every rank; if it raises a CheckpointError anywhere, raise on every rank."""
    try:
        value, problem = fn(), None
    except CheckpointError as e:
        value, problem = None, str(e)
    problems = sorted({p for p in _all_gather(problem) if p})
    if problems:
        raise CheckpointError(f"cannot load {what}: " + "; ".join(problems))
    return value


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(value):
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class _HashingFile:
    """A write-only file that hashes what passes through it: a save needs no second read."""

    def __init__(self, f) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(obj, path: Path) -> dict:
    """``torch.save`` ``obj`` to ``path``; its meta.json entry (size and sha256)."""
    with open(path, "wb") as f:
        out = _HashingFile(f)
        torch.save(obj, out)
        out.flush()
    return {"bytes": out.size, "sha256": out.digest.hexdigest()}


def _describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _check(path: Path, expected: dict | None) -> str | None:
    """What is wrong with one file against its meta entry, or None."""
    if expected is None:
        return "not listed in meta.json"
    if not path.exists():
        return "missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{size} bytes, meta.json says {expected['bytes']} (truncated or replaced)"
    if _sha256(path) != expected["sha256"]:
        return "checksum mismatch (the file changed after it was written)"
    return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local(obj):
    """Tensors as this rank's plain local values (FSDP2 DTensors -> their shard), recursively."""
    if hasattr(obj, "to_local"):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def _copy_into(module: torch.nn.Module, values: dict, folder: Path) -> None:
    own = dict(module.named_parameters(remove_duplicate=False))  # tied weights: under every name state_dict has
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    for name, value in values.items():
        if name not in own:
            raise CheckpointError(f"{folder}: key {name!r} is not in this model; same model and mesh?")
        target = own[name].to_local() if hasattr(own[name], "to_local") else own[name]
        if target.shape != value.shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(value.shape)}, this run's shard "
                                  f"{tuple(target.shape)}; resume with the mesh sizes it was written with")
        with torch.no_grad():
            target.copy_(value)


def _rewrap_optimizer_state(optimizer) -> None:
    """After load_state_dict, turn local moments of DTensor (FSDP2) parameters back into DTensors."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    optimizer.state[p][key] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements,
                                                                 shape=p.shape, stride=p.stride())


def _loader_state(loader) -> dict:
    """A prepared DataLoader's position: its stateful state, or its seedable sampler's epoch."""
    if getattr(loader, "use_stateful_dataloader", False):
        return {"stateful": loader.state_dict()}
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "epoch"):
        return {"epoch": int(sampler.epoch)}
    return {}


def _set_loader_state(loader, saved: dict) -> None:
    if "stateful" in saved:
        loader.load_state_dict(saved["stateful"])
    elif "epoch" in saved and hasattr(loader, "set_epoch"):
        loader.set_epoch(saved["epoch"])


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
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

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
