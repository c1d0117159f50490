"""What a checkpoint holds of a training run, per rank: the models' parameters and buffers under
their transformers names (split ones as blocks of the full tensor), the optimizers' state
under their parameters' names, the random states of each mesh coordinate, the error-feedback
residuals of a compressed dp gradient reduction (``grad_feedback.<model>.pp<p>.dp<d>.tp<t>.<name>``:
per coordinate, restored on the same mesh only, else started at zero with a warning), and the
shared values (schedulers, scaler, DataLoader positions, registered objects, step); `save` and
`load` of a `TrainingState`, resharding to the mesh it is loaded on."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import CheckpointError
from ...upstream import accelerate as upstream
from ...models.state import shard_specs
from ...parallel import ModelParts, ParallelDims
from ...parallel.stage import StageModule, taco_context
from .collective import agree, this_rank, world_size
from .storage import blocks_of, open_checkpoint, read, write

logger = logging.getLogger(__name__)


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
        lists = [upstream.prepared(accelerator, kind) for kind in ("optimizer", "scheduler", "dataloader", "custom")]
        return cls(accelerator.laid_out.parts, *lists, accelerator.scaler, accelerator)


def save(folder: str | os.PathLike, state: TrainingState, mesh, dims: ParallelDims, *, run: str | None = None,
         weights: list[dict] | None = None) -> Path:
    """Write ``state`` into ``folder`` (a collective over every rank); returns the folder.

    ``weights``: the models' entries to save, as `model_weights` gave them (a save hook may
    have dropped entries or whole models; model k of this list is saved as ``model.<k>``);
    default: every model whole. ``run``: the run's identity, kept in the commit record.
    """
    coords = _coords(mesh)
    made = [model_weights(parts) for parts in state.parts]
    weights = made if weights is None else weights
    owner = {id(w): i for i, w in enumerate(made)}
    layouts = [_layout(parts) for parts in state.parts]
    entries: dict[str, object] = {}
    for k, values in enumerate(weights):
        layout = layouts[owner.get(id(values), k)]
        for key, value in values.items():
            if value.is_meta:
                raise CheckpointError(f"{key} is on the meta device (a shape without values): load or initialise "
                                      "the weights before saving (taco_accel.from_pretrained reads them)")
            entries[f"model.{k}.{key}"] = blocks_of(value, *layout.get(key, (None, 0)))
    names = _parameter_names(state.parts)
    for j, opt in enumerate(state.optimizers):
        entries.update(_optimizer_entries(j, _inner(opt), names, layouts))
    entries[_rng_key(coords)] = _rng_state()
    for i, parts in enumerate(state.parts):
        entries.update({_feedback_prefix(i, coords) + name: value for name, value in parts.feedback_state().items()})
    if this_rank() == 0:
        entries["shared"] = {
            "schedulers": [s.state_dict() for s in state.schedulers],
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "dataloaders": [_loader_state(dl) for dl in state.dataloaders],
            "custom": [obj.state_dict() for obj in state.custom],
            "step": getattr(state.owner, "step", 0),
            "optimizer_steps": [getattr(opt, "steps", 0) for opt in state.optimizers],
        }
    # the record's step is the training step (optimizer steps taken), which a resume log shows;
    # Accelerate's own ``step`` counts accumulation calls (0 in a loop that never calls accumulate)
    record = {"run": run, "mesh": dataclasses.asdict(dims), "world_size": world_size(), "models": len(weights),
              "step": training_step(state.optimizers)}
    return write(folder, entries, record)


def training_step(optimizers: list) -> int:
    """The training step of a run: the most optimizer steps any of its optimizers took."""
    return max((getattr(opt, "steps", 0) for opt in optimizers), default=0)


def model_weights(parts: ModelParts) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers of one laid-out model under their transformers names
    (a pipeline stage's prefix removed): what a checkpoint saves of it."""
    out = {}
    for module in parts.modules:
        prefix = _stage_prefix(module)
        for name, value in module.state_dict().items():
            out[name[len(prefix):]] = value
    return out


def load(folder: str | os.PathLike, state: TrainingState, mesh, dims: ParallelDims,
         models: list[int] | None = None, strict: bool = True) -> dict:
    """Restore ``state`` from ``folder`` (a collective); returns its commit record.
    ``models``: the indices of the models to restore, the k-th from ``model.<k>`` (default: all;
    a load hook may have restored some itself). ``strict=False``: model entries the checkpoint
    lacks keep their values (a shape that differs still raises)."""
    folder = Path(folder)
    record, reader, known = open_checkpoint(folder)
    names = _parameter_names(state.parts)
    layouts = [_layout(parts) for parts in state.parts]
    models = list(range(len(state.parts))) if models is None else models

    def plan() -> tuple[dict, dict]:
        entries: dict[str, object] = {}
        extra: dict[str, object] = {}  # where the non-tensor values go
        for k, i in enumerate(models):
            for key, value in model_weights(state.parts[i]).items():
                if not strict and f"model.{k}.{key}" not in known:
                    continue
                _expect(known, f"model.{k}.{key}", value, layouts[i].get(key), folder)
                entries[f"model.{k}.{key}"] = blocks_of(value, *layouts[i].get(key, (None, 0)))
        for j, opt in enumerate(state.optimizers):
            entries.update(_optimizer_destinations(j, _inner(opt), names, layouts, known, folder, extra))
        entries[_rng_source(_coords(mesh), known, folder)] = None
        extra["feedback"] = _feedback_destinations(state.parts, models, _coords(mesh), record, dims, known, entries)
        if "shared" not in known:
            raise CheckpointError(f"{folder}: no 'shared' entry (schedulers, step): not a checkpoint of save_state")
        entries["shared"] = None
        return entries, extra

    entries, extra = agree(plan, f"checkpoint {folder}")
    read(reader, entries)
    for i, keys in extra["feedback"].items():
        state.parts[i].load_feedback_state({name: entries[key] for name, key in keys.items()})
    _restore(entries, extra, state, folder)
    logger.info("resumed from %s (saved at step %s on mesh %s)", folder, record.get("step"), record.get("mesh"))
    return record


def _restore(entries: dict, extra: dict, state: TrainingState, folder: Path) -> None:
    """Apply what the load read besides tensors, in Accelerate's order: optimizer
    hyper-parameters and scalars, schedulers, scaler, DataLoader positions, registered objects
    (after the rest: a run's own object may re-apply changed settings), step, random states."""
    shared = entries["shared"]
    if len(shared["custom"]) != len(state.custom):
        raise CheckpointError(f"{folder} holds {len(shared['custom'])} registered object(s), this run registered "
                              f"{len(state.custom)}: register the same objects (register_for_checkpointing)")
    for j, opt in enumerate(state.optimizers):
        inner = _inner(opt)
        groups = entries[f"optimizer.{j}.param_groups"]
        if len(groups) != len(inner.param_groups):
            raise CheckpointError(f"{folder}: optimizer {j} had {len(groups)} parameter group(s), this run's has "
                                  f"{len(inner.param_groups)}: build the optimizer as the saved run did")
        for group, saved in zip(inner.param_groups, groups):
            group.update(saved)
        for p, key, entry in extra[f"optimizer.{j}.scalars"]:
            inner.state[p][key] = entries[entry]
        for p in extra[f"optimizer.{j}.unsaved"]:
            inner.state.pop(p, None)
    for sched, saved in zip(state.schedulers, shared["schedulers"]):
        sched.load_state_dict(saved)
    if state.scaler is not None and shared["scaler"] is not None:
        state.scaler.load_state_dict(shared["scaler"])
    for dl, saved in zip(state.dataloaders, shared["dataloaders"]):
        _set_loader_state(dl, saved)
    for obj, saved in zip(state.custom, shared["custom"]):
        obj.load_state_dict(saved)
    for opt, steps in zip(state.optimizers, shared.get("optimizer_steps", [])):
        if hasattr(opt, "steps"):
            opt.steps = steps
    if state.owner is not None:
        state.owner.step = shared["step"]
    _set_rng_state(next(v for k, v in entries.items() if k.startswith("rng.")))


def _stage_prefix(module) -> str:
    return "model." if isinstance(module, StageModule) else ""


def _layout(parts: ModelParts) -> dict[str, tuple]:
    """Per transformers name of a split parameter: ``(ShardSpec, this rank's tp rank)``."""
    out = {}
    for module in parts.modules:
        ctx, _ = taco_context(module)
        rank = ctx.rank if ctx is not None else 0
        prefix = _stage_prefix(module)
        for name, spec in shard_specs(module).items():
            out[name[len(prefix):]] = (spec, rank)
    return out


def _parameter_names(parts_list: list[ModelParts]) -> dict[int, list[str]]:
    """Per parameter (by id), every name it has: ``"<model index>.<transformers name>"`` (a tied
    weight has two; a pipeline stage holds its own copy under one of them)."""
    names: dict[int, list[str]] = {}
    for i, parts in enumerate(parts_list):
        for module in parts.modules:
            prefix = _stage_prefix(module)
            for name, p in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(f"{i}.{name[len(prefix):]}")
    return names


def _param_layout(names: list[str], layouts: list[dict]) -> tuple:
    model, _, name = names[0].partition(".")
    return layouts[int(model)].get(name, (None, 0))


def _inner(optimizer):
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _optimizer_entries(j: int, opt, names: dict, layouts: list[dict]) -> dict:
    """Optimizer ``j``'s state under the names of its parameters (each name of a tied one)."""
    out = {f"optimizer.{j}.param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
    for p, values in opt.state.items():
        if id(p) not in names:
            raise CheckpointError("the optimizer holds a parameter of no prepared model; prepare the model and build "
                                  "the optimizer over its parameters")
        layout = _param_layout(names[id(p)], layouts)
        for name in names[id(p)]:
            for key, value in values.items():
                shaped = torch.is_tensor(value) and value.shape == p.shape and value.dim() > 0
                out[f"optimizer.{j}.state.{name}.{key}"] = blocks_of(value, *layout) if shaped else value
    return out


def _optimizer_destinations(j: int, opt, names: dict, layouts: list[dict], known: dict, folder: Path,
                            extra: dict) -> dict:
    """Where a load puts optimizer ``j``'s saved state: its own state tensors (created first by a
    step of zero gradients and learning rate, as `torch.distributed.checkpoint.state_dict` does);
    ``extra`` gets the non-tensor values' places and the parameters saved without state."""
    key = f"optimizer.{j}.param_groups"
    if key not in known:
        raise CheckpointError(f"{folder} holds no optimizer {j}: prepare the same optimizers before load_state")
    _init_state(opt)
    out = {key: None}
    scalars, unsaved = extra.setdefault(f"optimizer.{j}.scalars", []), extra.setdefault(f"optimizer.{j}.unsaved", [])
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a parameter of no prepared model; prepare the model and "
                                      "build the optimizer over its parameters")
            state = opt.state.get(p, {})
            name = next((n for n in names[id(p)] if any(f"optimizer.{j}.state.{n}.{k}" in known for k in state)), None)
            if name is None:  # saved before this parameter had state
                unsaved.append(p)
                continue
            layout = _param_layout(names[id(p)], layouts)
            for k, value in state.items():
                entry = f"optimizer.{j}.state.{name}.{k}"
                if entry not in known:
                    raise CheckpointError(f"{folder}: no optimizer state {k!r} for {name.partition('.')[2]}: the same "
                                          "optimizer type?")
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape:
                    _expect(known, entry, value, layout, folder)
                    out[entry] = blocks_of(value, *layout)
                elif torch.is_tensor(value):
                    _expect(known, entry, value, None, folder)
                    out[entry] = value
                else:
                    out[entry] = None
                    scalars.append((p, k, entry))
    return out


def _init_state(opt) -> None:
    """Create the optimizer's state tensors (their devices and dtypes are the optimizer's
    choice) by one step with zero gradients and a zero learning rate; the gradients the
    parameters had are put back."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state and opt.state[p] for p in params):
        return
    grads = {p: p.grad for p in params}
    lrs = [g.get("lr") for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad


def _expect(known: dict, key: str, value: torch.Tensor, layout, folder: Path) -> None:
    """A CheckpointError unless ``key`` is saved with the full shape ``value`` has here."""
    md = known.get(key)
    if md is None:
        raise CheckpointError(f"{folder} has no {key!r}: it was saved from another model (or other prepared "
                              "objects); load a checkpoint of this model")
    spec = layout[0] if layout else None
    full = list(value.shape)
    if spec is not None:
        full[spec.dim] = spec.full_size
    saved = getattr(md, "size", None)
    if saved is None or list(saved) != full:
        raise CheckpointError(f"{folder}: {key} has shape {list(saved) if saved is not None else 'none'} there and "
                              f"{full} in this model: another model (or vocabulary size)")


def _coords(mesh) -> dict[str, int]:
    return {name: mesh[name].get_local_rank() for name in ("pp", "dp", "tp")}


def _rng_key(coords: dict) -> str:
    return f"rng.pp{coords['pp']}.dp{coords['dp']}.tp{coords['tp']}"


def _feedback_prefix(model: int, coords: dict) -> str:
    return f"grad_feedback.{model}.pp{coords['pp']}.dp{coords['dp']}.tp{coords['tp']}."


def _feedback_destinations(parts_list: list[ModelParts], models: list[int], coords: dict, record: dict,
                           dims: ParallelDims, known: dict, entries: dict) -> dict[int, dict[str, str]]:
    """Where a load puts this coordinate's error-feedback residuals (``entries`` gets a tensor of
    the saved size for each): ``{model index: {name: entry}}``. Only on the mesh (and dp mode)
    they were saved on: elsewhere a rank's residuals have no counterpart (another split of the
    gradient among other ranks), so they start at zero, which loses at most one step's
    quantisation error of the gradient (logged once)."""
    out: dict[int, dict[str, str]] = {}
    for i in models:
        parts = parts_list[i]
        prefix = _feedback_prefix(i, coords)
        saved = {key[len(prefix):]: key for key in known if key.startswith(prefix)}
        if parts.grad_reduce is not None and saved and record.get("mesh") == dataclasses.asdict(dims):
            for key in saved.values():
                entries[key] = torch.empty(tuple(known[key].size), dtype=torch.float32, device=parts.device)
            out[i] = saved
        elif any(key.startswith(f"grad_feedback.{i}.") for key in known) and this_rank() == 0:
            logger.warning("the checkpoint holds the error-feedback residuals of a compressed dp gradient reduction "
                           "on mesh %s; this run has mesh %s%s: they are dropped (at most one step's quantisation "
                           "error of the gradient)", record.get("mesh"), dataclasses.asdict(dims),
                           "" if parts.grad_reduce is not None else " and no compressed reduction")
    return out


def _rng_source(coords: dict, known: dict, folder: Path) -> str:
    """The saved random states this coordinate takes: its own, else same pp and dp, else same
    pp, else rank 0's (a mesh the checkpoint did not have)."""
    p, d, t = coords["pp"], coords["dp"], coords["tp"]
    for key in (_rng_key(coords), _rng_key({"pp": p, "dp": d, "tp": 0}), _rng_key({"pp": p, "dp": 0, "tp": 0}),
                _rng_key({"pp": 0, "dp": 0, "tp": 0})):
        if key in known:
            return key
    raise CheckpointError(f"{folder} holds no random states: not a checkpoint of save_state")


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
