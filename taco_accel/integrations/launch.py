"""What ``accelerate launch`` hands a process, and the traps of starting one.

- ``accelerate launch --cpu --num_processes 2 script.py`` (and ``--num_processes 2`` without
  ``--multi_gpu`` on a machine without GPUs) starts ONE process: Accelerate's simple launcher
  ignores the count. Nothing in that process's environment says so; its parent's command line
  does (`launch_notes`). Two CPU processes need ``accelerate launch --multi_gpu
  --num_processes 2`` or a config with ``distributed_type: MULTI_GPU`` and ``use_cpu: true``
  (``recipes/configs/cpu_tp2.yaml``); `Accelerator` then reports MULTI_CPU and uses gloo.
- A config's ``parallelism_config`` block becomes ``ACCELERATE_USE_PARALLELISM_CONFIG`` and
  ``PARALLELISM_CONFIG_*_SIZE``; taco_accel reads the sizes and hides the switch from
  Accelerate (`without_parallelism_config`), which would build its own mesh or refuse TP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"


@contextlib.contextmanager
def without_parallelism_config():
    """Hide the launch's parallelism switch from an Accelerator being built (taco_accel owns the mesh)."""
    saved = os.environ.pop(USE_PARALLELISM_CONFIG, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[USE_PARALLELISM_CONFIG] = saved


def requested_processes(cmdline: list[str]) -> int | None:
    """The ``--num_processes`` / ``--num-processes`` of an ``accelerate launch`` command line."""
    head = cmdline[:4]
    if not ("launch" in head and any("accelerate" in part for part in head)) and "accelerate.commands.launch" not in head:
        return None
    for i, part in enumerate(cmdline):
        for flag in ("--num_processes", "--num-processes"):
            if part == flag and i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
                return int(cmdline[i + 1])
            if part.startswith(flag + "="):
                value = part.split("=", 1)[1]
                return int(value) if value.isdigit() else None
    return None


def launch_notes(num_processes: int) -> list[str]:
    """Warnings about how this process was started (empty when nothing looks wrong)."""
    if num_processes != 1:
        return []
    try:
        import psutil

        cmdline = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no psutil, no parent, no permission: nothing to say
        return []
    asked = requested_processes(cmdline)
    if asked is None or asked <= 1:
        return []
    return [
        f"`accelerate launch` was asked for {asked} processes but started one: Accelerate's simple launcher "
        f"(--cpu, or no --multi_gpu) ignores --num_processes. Run `accelerate launch --multi_gpu --num_processes "
        f"{asked} ...` (CPU machines too) or a config with distributed_type: MULTI_GPU and use_cpu: true "
        "(recipes/configs/cpu_tp2.yaml)"
    ]


def global_rank() -> int:
    """This process's rank: torch.distributed's, else the launcher's RANK (before the group exists)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def main_first(fn):
    """``fn()`` on global rank 0, then on the other ranks (downloads, tokenizers and caches are
    made once, then read); every rank returns its own result. If it raises on rank 0, every
    rank raises that error (the others do not wait for a result that never comes)."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            error = e
    if dist.is_initialized():
        box = [_portable(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise error if error is not None else box[0]
    elif error is not None:
        raise error
    if not is_main:
        result = fn()
    return result


def _portable(error: Exception | None):
    """``error`` if it survives pickling (to go to the other ranks), else a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def record_failure(message: str) -> None:
    """Leave ``message`` where torchrun's (and ``accelerate launch``'s) failure summary reads it:
    the ``TORCHELASTIC_ERROR_FILE`` of this process, so that the summary shows the cause
    instead of a pointer to the docs. Nothing without a launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    except OSError:  # a summary without the cause, as before
        pass


def usable_trackers(names) -> list[str]:
    """The Accelerate tracker names whose package is installed (the others dropped with a warning)."""
    usable = []
    for name in names:
        module = {"tensorboard": "torch.utils.tensorboard"}.get(name, name)
        try:
            __import__(module)
            usable.append(name)
        except ImportError:
            logger.warning("tracker %r is not installed; logging without it", name)
    return usable
