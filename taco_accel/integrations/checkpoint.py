"""Training checkpoints of a pp x dp x tp run: sharded, reshardable, atomic, checksummed, read
without running pickled code.

The one checkpoint format of taco_accel (`Accelerator.save_state` / ``load_state``; the
recipes' ``--save-every`` / ``--resume``). A checkpoint folder holds:

- ``taco_checkpoint.json``, the commit record, replaced last: format and version, the identity
  of the save and of the run, the mesh it was saved from, its data folder, and the size and
  sha256 of every file in it;
- ``taco_state-<save id>/``: a `torch.distributed.checkpoint` (DCP) folder holding every value
  under one name and its full, unsharded shape, each block written once by one of the ranks
  that hold it. ``model.<i>.<transformers name>``: parameters and buffers of prepared model
  i; ``optimizer.<j>.state.<i>.<parameter name>.<key>``: optimizer state (Adam's moments are
  split like their parameter); ``optimizer.<j>.param_groups``; ``rng.pp<p>.dp<d>.tp<t>``: the
  random states of each mesh coordinate; ``shared``: schedulers, the gradient scaler,
  DataLoader positions, registered objects and the step counter;
- whatever else the user keeps there: never read, written or deleted.

**Resharding**: each rank reads the blocks of the full tensors that its own shards cover (a
`ShardSpec` says which rows or columns a TP rank holds, FSDP2's DTensor which part of that),
whichever ranks wrote them, so a run saved at one mesh resumes at any other (pp, dp and tp
sizes, DDP or FSDP2) with the same numbers. Optimizer state is keyed by parameter name, so
pipeline stages may change; the random states of a coordinate the saved mesh lacks are those
of its nearest saved one (same pp and dp, else pp's, else rank 0's).

**Atomic**: a save writes a new data folder (its writer holds an exclusive ``flock`` on its
``.lock`` meanwhile), replaces the commit record in one rename, then deletes the data folder
the old record named. A job killed at any moment leaves the old checkpoint or the new one,
complete; the data folder of a killed save is deleted by a later save of the same folder once
no process holds its lock. Two jobs saving one folder each touch only their own data folder;
the later commit wins.

**Safe and bounded**: a load reads only the files the record lists, inside the checkpoint's own
data folder, each checked first to be a regular file (no symlink, FIFO or device) of the listed
size and checksum; DCP's metadata is unpickled with an allowlist of its own classes, every
other value with ``torch.load(weights_only=True)``. Every rank must load the same save (its
identity is compared). A problem names the file and raises `CheckpointError` on every rank at
once. `latest` skips damaged checkpoints with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import CheckpointError
from ..models.state import shard_specs
from ..parallel import ModelParts, ParallelDims
from ..parallel.stage import StageModule, taco_context

logger = logging.getLogger(__name__)

FORMAT = "taco_accel-checkpoint"
VERSION = 2
COMMIT = "taco_checkpoint.json"
DATA = re.compile(r"taco_state-[0-9a-f]{16}")
LOCK = ".lock"
NAME = re.compile(r"(?:step|checkpoint)_(?P<step>\d+)")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}|\.metadata")  # what DCP names its files
MAX_RECORD_BYTES = 64 << 20


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
            entries[f"model.{k}.{key}"] = _blocks(value, *layout.get(key, (None, 0)))
    names = _parameter_names(state.parts)
    for j, opt in enumerate(state.optimizers):
        entries.update(_optimizer_entries(j, _inner(opt), names, layouts))
    entries[_rng_key(coords)] = _rng_state()
    if _rank() == 0:
        entries["shared"] = {
            "schedulers": [s.state_dict() for s in state.schedulers],
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "dataloaders": [_loader_state(dl) for dl in state.dataloaders],
            "custom": [obj.state_dict() for obj in state.custom],
            "step": getattr(state.owner, "step", 0),
        }
    record = {"run": run, "mesh": dataclasses.asdict(dims), "world_size": _world(), "models": len(weights),
              "step": getattr(state.owner, "step", 0)}
    return write(folder, entries, record)


def write(folder: str | os.PathLike, entries: dict[str, object], record: dict | None = None) -> Path:
    """Save ``entries`` (DCP values: tensors, `Blocks`, picklable plain data) into ``folder``
    atomically and commit it with ``record`` added to the commit record (see the module doc).
    A collective; a failure on any rank raises `CheckpointError` on every rank and leaves the
    folder's previous checkpoint as it was."""
    folder = Path(folder)
    token = _broadcast(uuid.uuid4().hex[:16] if _rank() == 0 else None)
    data = folder / f"taco_state-{token}"
    lock = None
    try:
        lock = _on_rank0(lambda: _start(folder, data), f"cannot write a checkpoint into {folder}")
        writer = _Writer(data)
        try:
            with _single_process_quiet():
                dcp.save(entries, storage_writer=writer, planner=_SavePlanner(), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank failed
            raise CheckpointError(f"saving the checkpoint {folder} failed ({_cause(e)}); the checkpoint that was "
                                  "there (if any) is unchanged") from e
        reports = _all_gather({f"{data.name}/{name}": entry for name, entry in writer.fs.written.items()})
        files = {name: entry for report in reports for name, entry in report.items()}
        commit = {"format": FORMAT, "version": VERSION, "save": token, **(record or {}), "data": data.name,
                  "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": dict(sorted(files.items()))}
        _on_rank0(lambda: _commit(folder, data, commit), f"committing the checkpoint {folder} failed")
    except BaseException:
        if lock is not None and _referenced(folder) != data.name:
            shutil.rmtree(data, ignore_errors=True)  # our own temporary, never another writer's
        raise
    finally:
        if lock is not None:
            lock.close()  # releases the flock
    if _rank() == 0:
        logger.info("saved checkpoint %s", folder)
    return folder


def _on_rank0(fn, what: str):
    """``fn()`` on rank 0 (its value there, None elsewhere); if it fails, a `CheckpointError` on
    every rank (the others would otherwise wait in the next collective)."""
    value, problem = None, None
    if _rank() == 0:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - told to every rank
            problem = f"{what}: {_cause(e)}"
    problem = _broadcast(problem)
    if problem:
        raise CheckpointError(problem)
    return value


def _start(folder: Path, data: Path):
    """Make the folder and this save's data folder, lock it (held until the save ends), and
    delete data folders that killed saves left (unreferenced, lock free). Rank 0."""
    folder.mkdir(parents=True, exist_ok=True)
    data.mkdir()
    try:
        lock = open(data / LOCK, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        _delete_stale(folder, keep=data.name)
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)
        raise
    return lock


def _delete_stale(folder: Path, keep: str) -> None:
    for entry in folder.iterdir():
        if not DATA.fullmatch(entry.name) or entry.name == keep or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = os.open(entry / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # no lock file: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a save in progress (this job's or another's)
        try:
            if _referenced(folder) != entry.name:  # read under the lock: a commit cannot slip in between
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("deleted %s, left by a save that did not finish", entry)
        finally:
            os.close(fd)


def _referenced(folder: Path) -> str | None:
    """The data folder the commit record of ``folder`` names (None if it names none)."""
    try:
        record = json.loads(_read_regular(folder / COMMIT, MAX_RECORD_BYTES))
        return record.get("data") if isinstance(record, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def _commit(folder: Path, data: Path, record: dict) -> None:
    """Replace the commit record (one rename), then delete the data folder the old one named."""
    old = _referenced(folder)
    tmp = data / (COMMIT + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMMIT)
    _fsync_dir(folder)
    if old is not None and old != data.name and DATA.fullmatch(old):
        shutil.rmtree(folder / old, ignore_errors=True)


def new_run_identity() -> str:
    """A fresh run identity, the same on every rank (a collective)."""
    return _broadcast(uuid.uuid4().hex if _rank() == 0 else None)


def model_weights(parts: ModelParts) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers of one laid-out model under their transformers names
    (a pipeline stage's prefix removed): what a checkpoint saves of it."""
    out = {}
    for module in parts.modules:
        prefix = _stage_prefix(module)
        for name, value in module.state_dict().items():
            out[name[len(prefix):]] = value
    return out


# -- loading ------------------------------------------------------------------------------------
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
                entries[f"model.{k}.{key}"] = _blocks(value, *layouts[i].get(key, (None, 0)))
        for j, opt in enumerate(state.optimizers):
            entries.update(_optimizer_destinations(j, _inner(opt), names, layouts, known, folder, extra))
        entries[_rng_source(_coords(mesh), known, folder)] = None
        if "shared" not in known:
            raise CheckpointError(f"{folder}: no 'shared' entry (schedulers, step): not a checkpoint of save_state")
        entries["shared"] = None
        return entries, extra

    entries, extra = _agree(plan, f"checkpoint {folder}")
    read(reader, entries)
    _restore(entries, extra, state, folder)
    logger.info("resumed from %s (saved at step %s on mesh %s)", folder, record.get("step"), record.get("mesh"))
    return record


def open_checkpoint(folder: str | os.PathLike) -> tuple[dict, "_Reader", dict]:
    """`verify` ``folder``, then read its DCP metadata (a collective); returns the commit
    record, a reader for `read`, and ``{entry name: its DCP storage metadata}``."""
    folder = Path(folder)
    record = verify(folder)
    reader = _Reader(folder / record["data"], {name.split("/", 1)[1] for name in record["files"]})
    metadata = _agree(reader.read_metadata, f"checkpoint {folder}")
    return record, reader, metadata.state_dict_metadata


def read(reader: "_Reader", entries: dict) -> dict:
    """Load the saved values of ``entries`` (a collective): tensors and `Blocks` are filled in
    place, any other value is replaced by the saved one; returns ``entries``."""
    try:
        with _single_process_quiet():
            dcp.load(entries, storage_reader=reader, planner=_LoadPlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load checkpoint {Path(reader.path).parent}: {_cause(e)}") from e
    return entries


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
    if state.owner is not None:
        state.owner.step = shared["step"]
    _set_rng_state(next(v for k, v in entries.items() if k.startswith("rng.")))


def verify(folder: str | os.PathLike) -> dict:
    """Check ``folder``'s commit record and every file it lists (a collective: each rank
    hashes a share of the files, every rank stats all of them; every rank must name the same
    save); returns the record, or raises `CheckpointError` on every rank."""
    folder = Path(folder)
    record = _agree(lambda: read_record(folder), f"checkpoint {folder}")
    seen = _all_gather((str(folder), record["save"], record.get("run")))
    if len({save for _, save, _ in seen}) > 1:
        listing = "; ".join(f"rank {r}: {f} (save {s}, run {run})" for r, (f, s, run) in enumerate(seen))
        raise CheckpointError(f"the ranks would resume from different checkpoints ({listing}): every rank must load "
                              "the same one; pass the same folder on a filesystem every rank sees")
    problems = [p for part in _all_gather(_problems(folder, record, _rank(), _world())) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems)
                              + "; resume from an earlier checkpoint (--resume <folder>) or restore it from a copy")
    return record


def read_record(folder: Path) -> dict:
    """The commit record of ``folder``, checked for shape and safe file names."""
    path = folder / COMMIT
    try:
        text = _read_regular(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        if '"taco_accel-checkpoint"' in _head(folder / "meta.json"):
            raise CheckpointError(f"{folder} was written by an older taco_accel (checkpoint format 1), which this "
                                  "version does not read: resume it with the version that wrote it, or start anew") from None
        raise CheckpointError(f"{folder} holds no complete checkpoint (no {COMMIT}): not a checkpoint folder, or its "
                              "save did not finish; resume from another one") from None
    except OSError as e:
        raise CheckpointError(f"{path}: {e}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): truncated or "
                              "edited; resume from an earlier checkpoint") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be a commit record; resume from an earlier "
                              "checkpoint") from None
    problem = _record_problem(record)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return record


def _record_problem(record) -> str | None:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"not a {FORMAT} record"
    if record.get("version") != VERSION:
        return f"format version {record.get('version')!r}; this code reads version {VERSION}"
    data, files, save = record.get("data"), record.get("files"), record.get("save")
    if not isinstance(save, str) or not isinstance(data, str) or not DATA.fullmatch(data):
        return f"data folder {data!r} / save {save!r}: not names this format writes"
    if not isinstance(files, dict) or not files:
        return "no files listed"
    for name, entry in files.items():
        head, _, tail = name.partition("/") if isinstance(name, str) else ("", "", "")
        if head != data or not FILE_NAME.fullmatch(tail):
            return (f"lists {name!r}, outside its data folder {data}/: a checkpoint is read from its own folder "
                    "only (planted or edited record)")
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or entry["bytes"] < 0 \
                or not isinstance(entry.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            return f"the entry of {name} is not {{'bytes': size, 'sha256': hex digest}}"
    return None


def latest(root: str | os.PathLike, mesh=None) -> Path | None:
    """The newest complete, undamaged checkpoint folder (``step_<N>`` / ``checkpoint_<N>``)
    under ``root``, or None when there is none. Damaged ones are skipped with a warning that
    names their files; if every one is damaged, a `CheckpointError`. A collective (it also
    works without torch.distributed, for a look at a run's folder)."""
    root = Path(root)
    found = _broadcast(_candidates(root) if _rank() == 0 else None)
    damaged = []
    for folder in found:
        try:
            verify(folder)
            return folder
        except CheckpointError as e:
            damaged.append(folder)
            if _rank() == 0:
                logger.warning("skipping %s: %s", folder, e)
    if damaged:
        raise CheckpointError(f"every checkpoint under {root} is damaged ({', '.join(map(str, damaged))}); "
                              "start without --resume or restore them from a copy")
    return None


def prune(root: Path, keep: int) -> None:
    """Delete the oldest complete checkpoints under ``root`` so that at most ``keep`` remain."""
    for folder in _candidates(root)[max(keep, 0):]:
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("deleted checkpoint %s (total_limit)", folder)


def exists(root: str | os.PathLike) -> bool:
    """Whether ``root`` holds any checkpoint folder (complete or not)."""
    root = Path(root)
    return root.is_dir() and any(NAME.fullmatch(p.name) and p.is_dir() for p in root.iterdir())


# -- DCP plumbing: blocks of full tensors, planners, storage ------------------------------------
class Blocks:
    """One full (unsharded) tensor as the blocks of it this rank holds: ``(offsets in the full
    tensor, a view of local storage)``. DCP writes the blocks under their offsets and, on a
    load, reads each block from whatever saved blocks overlap it (`_SavePlanner`, `_LoadPlanner`)."""

    def __init__(self, full_size: torch.Size, blocks: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.full_size, self.blocks = torch.Size(full_size), [(torch.Size(o), v) for o, v in blocks if v.numel()]

    def size(self) -> torch.Size:
        return self.full_size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.full_size))
                for offsets, view in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size()) for offsets, view in self.blocks]

    def block(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.blocks) and self.blocks[index.index][0] == index.offset:
            return self.blocks[index.index][1]
        return next(view for offsets, view in self.blocks if offsets == index.offset)


def _blocks(value: torch.Tensor, spec=None, tp_rank: int = 0):
    """``value`` (this rank's tensor; an FSDP2 DTensor: its shard) as `Blocks` of the full
    tensor that ``spec`` (a `ShardSpec`, None: not split over tp) assembles; a plain tensor
    when it is whole."""
    local, inner = value, [0] * value.dim()
    if hasattr(value, "to_local"):  # FSDP2: this rank's rows of the tp-local tensor
        inner, local = list(value.__create_chunk_list__()[0].offsets), value.to_local()
    if spec is None and local is value:
        return value
    full = list(value.shape)
    if spec is None:
        return Blocks(torch.Size(full), [(tuple(inner), local)])
    d = spec.dim
    full[d] = spec.full_size
    a, b = inner[d], inner[d] + local.shape[d]  # the local rows along d, in the tp-local tensor
    blocks, lo = [], 0
    for start, stop in spec.ranges[tp_rank]:
        s, e = max(a, lo), min(b, lo + stop - start)
        if s < e:
            offsets = list(inner)
            offsets[d] = start + s - lo
            blocks.append((tuple(offsets), local.narrow(d, s - a, e - s)))
        lo += stop - start
    return Blocks(torch.Size(full), blocks)


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.block(index) if isinstance(obj, Blocks) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, taking `Blocks` and reading non-tensor values with weights_only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's own set-up rebuilds the dict and drops values of types it does not know (`Blocks`)
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.block(index) if isinstance(obj, Blocks) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling refusal: not a value this code wrote
            lines = [line for line in str(e).splitlines() if line.strip()]
            reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(e).__name__)
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r} refused by torch.load(weights_only=True) "
                                  f"({reason.strip()}); a taco_accel checkpoint holds tensors, numbers, strings and "
                                  "containers only: planted or foreign data") from e


class _HashingFile:
    """A write-only stream that hashes what passes through it: a save needs no second read."""

    def __init__(self, f) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def __getattr__(self, name: str):  # tell, flush, fileno, ...
        return getattr(self.f, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and sha256 of every file this rank writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            out = _HashingFile(stream)
            yield out
        self.written[Path(path).name] = {"bytes": out.size, "sha256": out.digest.hexdigest()}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.written:
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class _Writer(FileSystemWriter):
    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = _HashingFileSystem()


class _Reader(FileSystemReader):
    """DCP's reader, with the metadata unpickled through an allowlist (`_MetadataUnpickler`)
    and only the files the commit record lists (and verified) opened."""

    def __init__(self, path: Path, listed: set[str]) -> None:
        super().__init__(path)
        self.listed = listed

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        if ".metadata" not in self.listed:
            raise CheckpointError(f"{path} is not listed in {COMMIT}")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:
            raise CheckpointError(f"{path}: not DCP metadata ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - self.listed)
        if unlisted:
            raise CheckpointError(f"{path} points at {unlisted[:3]}, which {COMMIT} does not list: planted or edited")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "Path"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: unpickle it with only DCP's own metadata classes, torch
    sizes and dtypes allowed, so that a planted file cannot run code."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never holds "
                              "(planted file)")


# -- what a checkpoint holds, per rank ----------------------------------------------------------
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
                out[f"optimizer.{j}.state.{name}.{key}"] = _blocks(value, *layout) if shaped else value
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
                    out[entry] = _blocks(value, *layout)
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


def _rng_source(coords: dict, known: dict, folder: Path) -> str:
    """The saved random states this coordinate takes: its own, else same pp and dp, else same
    pp, else rank 0's (a mesh the checkpoint did not have)."""
    p, d, t = coords["pp"], coords["dp"], coords["tp"]
    for key in (_rng_key(coords), _rng_key({"pp": p, "dp": d, "tp": 0}), _rng_key({"pp": p, "dp": 0, "tp": 0}),
                _rng_key({"pp": 0, "dp": 0, "tp": 0})):
        if key in known:
            return key
    raise CheckpointError(f"{folder} holds no random states: not a checkpoint of save_state")


# -- helpers ------------------------------------------------------------------------------------
def _candidates(root: Path) -> list[Path]:
    """Checkpoint folders with a commit record, newest step first."""
    if not root.is_dir():
        return []
    done = []
    for p in root.iterdir():
        match = NAME.fullmatch(p.name)
        if not match or not p.is_dir():
            continue
        if (p / COMMIT).exists():
            done.append((-int(match.group("step")), p))
        else:
            logger.warning("ignoring %s: no %s (a save that did not finish, or not a checkpoint of this version)",
                           p, COMMIT)
    return [p for _, p in sorted(done)]


def _problems(folder: Path, record: dict, rank: int, world: int) -> list[str]:
    """What is wrong with the files of ``record``: every file stat'ed, a share hashed."""
    data = folder / record["data"]
    try:
        if not stat.S_ISDIR(os.lstat(data).st_mode):
            return [f"{data} is not a folder (a symlink or a file)"]
    except OSError as e:
        return [f"{data}: {e.strerror or e}"]
    names = sorted(record["files"])
    problems = []
    for index, name in enumerate(names):
        problem = _check(folder / name, record["files"][name], hash_it=index % world == rank)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _check(path: Path, expected: dict, hash_it: bool = True) -> str | None:
    """What is wrong with one file against its record entry, or None. Never blocks: a FIFO or
    device is refused before it is opened."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return str(e.strerror or e)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a symlink, FIFO, device or folder); a checkpoint holds plain files only"
    if st.st_size != expected["bytes"]:
        return f"{st.st_size} bytes, {COMMIT} says {expected['bytes']} (truncated or replaced)"
    try:
        if hash_it and _sha256(path, expected["bytes"]) != expected["sha256"]:
            return "checksum mismatch (the file changed after it was written)"
    except OSError as e:  # replaced since the stat
        return str(e.strerror or e)
    return None


def _open_regular(path: Path):
    """``path`` opened for reading if it is a regular file (not a symlink, FIFO, device or
    folder: opening a FIFO would wait for a writer, a device never end), else an OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # O_NOFOLLOW: a symlink fails here
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file (a symlink, FIFO, device or folder)", str(path))
    return f


def _read_regular(path: Path, limit: int) -> str:
    """The text of a regular file of at most ``limit`` bytes."""
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than a record's {limit}", str(path))
        return f.read(limit + 1).decode("utf-8", errors="replace")


def _head(path: Path, size: int = 4096) -> str:
    """The first ``size`` bytes of a regular file as text ("" for anything else)."""
    try:
        with _open_regular(path) as f:
            return f.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _sha256(path: Path, size: int) -> str:
    """The sha256 of a regular file's first ``size + 1`` bytes (the listed size and one more)."""
    digest = hashlib.sha256()
    with _open_regular(path) as f:
        left = size + 1
        for block in iter(lambda: f.read(min(1 << 24, left)), b""):
            digest.update(block)
            left -= len(block)
            if left <= 0:
                break
    return digest.hexdigest()


def _describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path, path.stat().st_size)}


def _cause(error: BaseException) -> str:
    """The innermost message of a (DCP-wrapped) exception, errno names spelled out."""
    seen = error
    while seen.__cause__ is not None and not isinstance(seen, CheckpointError):  # ours says it best
        seen = seen.__cause__
    text = str(seen) or type(seen).__name__
    if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
        text = f"no space left on the device ({text}); free space or save elsewhere"
    if isinstance(error, CheckpointException):  # DCP: per failed rank, (exception, stack)
        text = "; ".join(f"rank {r}: {_cause(failure[0])}" for r, failure in sorted(error.failures.items()))
    return text


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


@contextlib.contextmanager
def _single_process_quiet():
    """Without torch.distributed (a look at a run's folder), DCP warns that it assumes one process: it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
