"""The commit record ``taco_checkpoint.json``: its format, the atomic steps of a save around it
(a locked data folder of its own, one rename to commit, the old data folder deleted after), and
the checks of a load (the record's shape, every listed file's size and checksum, every rank on
the same save); finding the newest undamaged checkpoint of a run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from ...errors import CheckpointError
from .collective import all_gather, agree, broadcast, this_rank, world_size
from .files import file_head, fsync_dir, read_regular, sha256

logger = logging.getLogger(__name__)


FORMAT = "taco_accel-checkpoint"
VERSION = 2
COMMIT = "taco_checkpoint.json"
DATA = re.compile(r"taco_state-[0-9a-f]{16}")
LOCK = ".lock"
NAME = re.compile(r"(?:step|checkpoint)_(?P<step>\d+)")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}|\.metadata")  # what DCP names its files
MAX_RECORD_BYTES = 64 << 20


def begin_save(folder: Path, data: Path):
    """Make the folder and this save's data folder, lock it (held until the save ends), and
    delete data folders that killed saves left (unreferenced, lock free). Rank 0; returns the
    open lock and whether this save made ``folder``."""
    made = not folder.is_dir()
    folder.mkdir(parents=True, exist_ok=True)
    data.mkdir()
    try:
        lock = open(data / LOCK, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        _delete_stale(folder, keep=data.name)
    except BaseException:
        abandon_save(folder, data, made)
        raise
    return lock, made


def abandon_save(folder: Path, data: Path, made: bool) -> None:
    """Delete what a save that failed before its commit made: its data folder, and ``folder``
    itself if the save made it and nothing else is in it (no empty ``step_N/`` left behind)."""
    shutil.rmtree(data, ignore_errors=True)
    if made:
        with contextlib.suppress(OSError):  # not empty: someone else's files, kept
            folder.rmdir()


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
            if referenced(folder) != entry.name:  # read under the lock: a commit cannot slip in between
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("deleted %s, left by a save that did not finish", entry)
        finally:
            os.close(fd)


def referenced(folder: Path) -> str | None:
    """The data folder the commit record of ``folder`` names (None if it names none)."""
    try:
        record = json.loads(read_regular(folder / COMMIT, MAX_RECORD_BYTES))
        return record.get("data") if isinstance(record, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def commit_record(folder: Path, data: Path, record: dict) -> None:
    """Replace the commit record (one rename), then delete the data folder the old one named."""
    old = referenced(folder)
    tmp = data / (COMMIT + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMMIT)
    fsync_dir(folder)
    if old is not None and old != data.name and DATA.fullmatch(old):
        shutil.rmtree(folder / old, ignore_errors=True)


def new_run_identity() -> str:
    """A fresh run identity, the same on every rank (a collective)."""
    return broadcast(uuid.uuid4().hex if this_rank() == 0 else None)


def verify(folder: str | os.PathLike) -> dict:
    """Check ``folder``'s commit record and every file it lists (a collective: each rank
    hashes a share of the files, every rank stats all of them; every rank must name the same
    save); returns the record, or raises `CheckpointError` on every rank."""
    folder = Path(folder)
    record = agree(lambda: read_record(folder), f"checkpoint {folder}")
    seen = all_gather((str(folder), record["save"], record.get("run")))
    if len({save for _, save, _ in seen}) > 1:
        listing = "; ".join(f"rank {r}: {f} (save {s}, run {run})" for r, (f, s, run) in enumerate(seen))
        raise CheckpointError(f"the ranks would resume from different checkpoints ({listing}): every rank must load "
                              "the same one; pass the same folder on a filesystem every rank sees")
    problems = [p for part in all_gather(_problems(folder, record, this_rank(), world_size())) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems)
                              + "; resume from an earlier checkpoint (--resume <folder>) or restore it from a copy")
    return record


def read_record(folder: Path) -> dict:
    """The commit record of ``folder``, checked for shape and safe file names."""
    path = folder / COMMIT
    try:
        text = read_regular(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        if '"taco_accel-checkpoint"' in file_head(folder / "meta.json"):
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
        if hash_it and sha256(path, expected["bytes"]) != expected["sha256"]:
            return "checksum mismatch (the file changed after it was written)"
    except OSError as e:  # replaced since the stat
        return str(e.strerror or e)
    return None


def latest(root: str | os.PathLike, mesh=None) -> Path | None:
    """The newest complete, undamaged checkpoint folder (``step_<N>`` / ``checkpoint_<N>``)
    under ``root``, or None when there is none. Damaged ones are skipped with a warning that
    names their files; if every one is damaged, a `CheckpointError` that names each one and
    why. A collective (it also works without torch.distributed, for a look at a run's folder)."""
    root = Path(root)
    found = broadcast(candidates(root) if this_rank() == 0 else None)
    damaged = []
    for folder in found:
        try:
            verify(folder)
            return folder
        except CheckpointError as e:
            damaged.append(f"[{folder.name}] {e}")
            if this_rank() == 0:
                logger.warning("skipping %s: %s", folder, e)
    if damaged:
        raise CheckpointError(f"every checkpoint under {root} is damaged: " + " ".join(damaged)
                              + " -- start without --resume or restore them from a copy")
    return None


def prune(root: Path, keep: int) -> None:
    """Delete the oldest complete checkpoints under ``root`` so that at most ``keep`` remain."""
    for folder in candidates(root)[max(keep, 0):]:
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("deleted checkpoint %s (total_limit)", folder)


def exists(root: str | os.PathLike) -> bool:
    """Whether ``root`` holds any committed checkpoint folder (complete or damaged; the folder
    of a save killed before its commit holds no checkpoint and does not count)."""
    root = Path(root)
    return root.is_dir() and any(NAME.fullmatch(p.name) and p.is_dir() and os.path.lexists(p / COMMIT)
                                 for p in root.iterdir())


def candidates(root: Path) -> list[Path]:
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
