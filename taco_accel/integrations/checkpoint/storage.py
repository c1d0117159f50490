"""The checkpoint's data through `torch.distributed.checkpoint` (DCP): full tensors as the blocks
each rank holds (`Blocks`), planners that take them, a writer that hashes every file it writes
and a reader that opens only the files the commit record lists, its metadata unpickled through
an allowlist and every other value with ``torch.load(weights_only=True)``; `write` (an atomic
save of entries under a commit record), `open_checkpoint` and `read`."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import time
import uuid
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

from ...errors import CheckpointError
from .collective import agree, all_gather, broadcast, cause, on_rank0, single_process_quiet, this_rank
from .record import COMMIT, FORMAT, VERSION, abandon_save, begin_save, commit_record, referenced, verify

logger = logging.getLogger(__name__)


def write(folder: str | os.PathLike, entries: dict[str, object], record: dict | None = None) -> Path:
    """Save ``entries`` (DCP values: tensors, `Blocks`, picklable plain data) into ``folder``
    atomically and commit it with ``record`` added to the commit record (see the module doc).
    A collective; a failure on any rank raises `CheckpointError` on every rank and leaves the
    folder's previous checkpoint as it was."""
    folder = Path(folder)
    token = broadcast(uuid.uuid4().hex[:16] if this_rank() == 0 else None)
    data = folder / f"taco_state-{token}"
    lock = made = None
    try:
        opened = on_rank0(lambda: begin_save(folder, data), f"cannot write a checkpoint into {folder}")
        lock, made = opened if opened is not None else (None, False)
        writer = _Writer(data)
        try:
            with single_process_quiet():
                dcp.save(entries, storage_writer=writer, planner=_SavePlanner(), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank failed
            raise CheckpointError(f"saving the checkpoint {folder} failed ({cause(e)}); the checkpoint that was "
                                  "there (if any) is unchanged") from e
        reports = all_gather({f"{data.name}/{name}": entry for name, entry in writer.fs.written.items()})
        files = {name: entry for report in reports for name, entry in report.items()}
        commit = {"format": FORMAT, "version": VERSION, "save": token, **(record or {}), "data": data.name,
                  "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": dict(sorted(files.items()))}
        on_rank0(lambda: commit_record(folder, data, commit), f"committing the checkpoint {folder} failed")
    except BaseException:
        if lock is not None and referenced(folder) != data.name:
            abandon_save(folder, data, made)  # our own temporary, never another writer's
        raise
    finally:
        if lock is not None:
            lock.close()  # releases the flock
    if this_rank() == 0:
        logger.info("saved checkpoint %s", folder)
    return folder


def open_checkpoint(folder: str | os.PathLike) -> tuple[dict, "_Reader", dict]:
    """`verify` ``folder``, then read its DCP metadata (a collective); returns the commit
    record, a reader for `read`, and ``{entry name: its DCP storage metadata}``."""
    folder = Path(folder)
    record = verify(folder)
    reader = _Reader(folder / record["data"], {name.split("/", 1)[1] for name in record["files"]})
    metadata = agree(reader.read_metadata, f"checkpoint {folder}")
    return record, reader, metadata.state_dict_metadata


def read(reader: "_Reader", entries: dict) -> dict:
    """Load the saved values of ``entries`` (a collective): tensors and `Blocks` are filled in
    place, any other value is replaced by the saved one; returns ``entries``."""
    try:
        with single_process_quiet():
            dcp.load(entries, storage_reader=reader, planner=_LoadPlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load checkpoint {Path(reader.path).parent}: {cause(e)}") from e
    return entries


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


def blocks_of(value: torch.Tensor, spec=None, tp_rank: int = 0):
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
