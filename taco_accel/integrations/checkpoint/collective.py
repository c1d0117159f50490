"""What every rank of a checkpoint's save or load agrees on: rank 0's value on every rank, a
problem on any rank raised on every rank, the innermost cause of a (DCP-wrapped) failure. All of
it also works without torch.distributed (a look at a run's folder from one process)."""

from __future__ import annotations

import contextlib
import errno
import warnings

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ...errors import CheckpointError


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast(value):
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def on_rank0(fn, what: str):
    """``fn()`` on rank 0 (its value there, None elsewhere); if it fails, a `CheckpointError` on
    every rank (the others would otherwise wait in the next collective)."""
    value, problem = None, None
    if this_rank() == 0:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - told to every rank
            problem = f"{what}: {cause(e)}"
    problem = broadcast(problem)
    if problem:
        raise CheckpointError(problem)
    return value


def agree(fn, what: str):
    """``fn()`` on every rank; if it raises a CheckpointError anywhere, raise on every rank."""
    try:
        value, problem = fn(), None
    except CheckpointError as e:
        value, problem = None, str(e)
    problems = sorted({p for p in all_gather(problem) if p})
    if problems:
        raise CheckpointError(f"cannot load {what}: " + "; ".join(problems))
    return value


def cause(error: BaseException) -> str:
    """The innermost message of a (DCP-wrapped) exception, errno names spelled out."""
    seen = error
    while seen.__cause__ is not None and not isinstance(seen, CheckpointError):  # ours says it best
        seen = seen.__cause__
    text = str(seen) or type(seen).__name__
    if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
        text = f"no space left on the device ({text}); free space or save elsewhere"
    if isinstance(error, CheckpointException):  # DCP: per failed rank, (exception, stack)
        text = "; ".join(f"rank {r}: {cause(failure[0])}" for r, failure in sorted(error.failures.items()))
    return text


@contextlib.contextmanager
def single_process_quiet():
    """Without torch.distributed (a look at a run's folder), DCP warns that it assumes one process: it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
