"""Safe reads of a checkpoint's files: only regular files (a symlink, FIFO or device is refused
before it is opened, so a read never blocks), of bounded size, with their sha256; and the
directory sync that makes a rename durable."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path


def open_regular(path: Path):
    """``path`` opened for reading if it is a regular file (not a symlink, FIFO, device or
    folder: opening a FIFO would wait for a writer, a device never end), else an OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # O_NOFOLLOW: a symlink fails here
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file (a symlink, FIFO, device or folder)", str(path))
    return f


def read_regular(path: Path, limit: int) -> str:
    """The text of a regular file of at most ``limit`` bytes."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than a record's {limit}", str(path))
        return f.read(limit + 1).decode("utf-8", errors="replace")


def file_head(path: Path, size: int = 4096) -> str:
    """The first ``size`` bytes of a regular file as text ("" for anything else)."""
    try:
        with open_regular(path) as f:
            return f.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def sha256(path: Path, size: int) -> str:
    """The sha256 of a regular file's first ``size + 1`` bytes (the listed size and one more)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        left = size + 1
        for block in iter(lambda: f.read(min(1 << 24, left)), b""):
            digest.update(block)
            left -= len(block)
            if left <= 0:
                break
    return digest.hexdigest()


def describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256(path, path.stat().st_size)}


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
