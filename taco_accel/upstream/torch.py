"""torch's private names that taco_accel relies on.

- ``torch.distributed.distributed_c10d._get_process_group_store``: the key-value store a process
  group was made with. The ranks of a group whose collective timed out compare there what they
  fed the group (`comm.agreement.timeout_error`): a timed-out gloo or NCCL group cannot be trusted
  with another collective, its store still answers. 2.11-2.15 (2.11 and 2.15 read).

No entry point calls `check_version`: the name is read on that error path only, and a torch
without it gives the plain timeout error there instead (tests/test_upstream.py checks the range).
"""

from __future__ import annotations

from .versions import check_range

SUPPORTED = ("2.11", "2.16")


def check_version() -> str | None:
    """The installed torch version; a ConfigError outside `SUPPORTED`."""
    return check_range("torch", *SUPPORTED)


def group_store(group):
    """The store of ``group`` (None: the default group's), or None where this torch has no such
    name or the group none (a caller on an error path then goes without)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_process_group_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError, KeyError):
        return None
