"""What ``accelerate launch`` hands a process, and the traps of starting one.

- ``accelerate launch --cpu --num_processes 2 script.py`` (and ``--num_processes 2`` without
  ``--multi_gpu`` on a machine without GPUs) starts ONE process: Accelerate's simple launcher
  ignores the count. Nothing in that process's environment says so; its parent's command line
  does (`launch_notes`). Two CPU processes need ``accelerate launch --multi_gpu
  --num_processes 2`` or a config with ``distributed_type: MULTI_GPU`` and ``use_cpu: true``
  (``recipes/configs/cpu_tp2.yaml``); `Accelerator` then reports MULTI_CPU and uses gloo.
- A config's ``parallelism_config`` block becomes ``ACCELERATE_USE_PARALLELISM_CONFIG`` and
  ``PARALLELISM_CONFIG_*_SIZE``; taco_accel reads the sizes itself (`parallel.mesh.launch_sizes`)
  and hides the switch from Accelerate (`without_parallelism_config`), which would build its own
  mesh or refuse TP.
"""

from __future__ import annotations

import contextlib
import os

from ..parallel.mesh import USE_PARALLELISM_CONFIG


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
