"""The Accelerate glue: sizes from ``accelerate launch``, an Accelerator for the rest.

Accelerate's ParallelismConfig builds a mesh of (dp_replicate, dp_shard, cp, sp, tp): it has no
pipeline axis, rejects TP on CPU (MULTI_CPU) and TP with replicated data parallelism, and it
shards nothing itself. So taco_accel reads the sizes that ``accelerate launch`` exports
(``PARALLELISM_CONFIG_*``, plus ``TACO_PP_SIZE``), builds its own ("pp", "dp", "tp") mesh
(`taco_accel.parallel.build_mesh`), and uses the Accelerator for what it is good at: process
state, mixed-precision autocast, trackers (TensorBoard, ...) and main-process printing.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from ..parallel import ParallelDims

logger = logging.getLogger(__name__)

_ACCELERATE_PC = "ACCELERATE_USE_PARALLELISM_CONFIG"


def parallel_dims_from_launch(*, pp: int | None = None, dp: int | None = None, tp: int | None = None,
                              dp_mode: str | None = None, world_size: int | None = None) -> ParallelDims:
    """The mesh sizes of this run: explicit values first, then ``accelerate launch``'s
    environment (see `ParallelDims.from_env`)."""
    return ParallelDims.from_env(world_size, pp=pp, dp=dp, tp=tp, dp_mode=dp_mode)


@contextlib.contextmanager
def _without_parallelism_config():
    """Hide ParallelismConfig from the Accelerator: taco_accel owns the mesh (see module doc)."""
    saved = os.environ.pop(_ACCELERATE_PC, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[_ACCELERATE_PC] = saved


def make_accelerator(*, mixed_precision: str = "no", trackers: tuple[str, ...] | list[str] = ("tensorboard",),
                     project_dir: str | None = None, cpu: bool | None = None):
    """An Accelerator for process state, autocast and trackers (never for model preparation).

    ``trackers`` are Accelerate tracker names ("tensorboard", "wandb", ...); the ones whose
    package is missing are dropped with a warning on the main process.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    usable = []
    for name in trackers:
        module = {"tensorboard": "torch.utils.tensorboard"}.get(name, name)
        try:
            __import__(module)
            usable.append(name)
        except ImportError:
            logger.warning("tracker %r is not installed; logging without it", name)
    with _without_parallelism_config():
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available() if cpu is None else cpu,
            mixed_precision=mixed_precision,
            log_with=usable or None,
            project_config=ProjectConfiguration(project_dir=project_dir, logging_dir=project_dir) if project_dir else None,
        )
    return accelerator


def main_first(fn):
    """``fn()`` on global rank 0, then on the other ranks (downloads, tokenizers and caches are
    made once, then read); every rank returns its own result."""
    is_main = dist.get_rank() == 0
    if is_main:
        result = fn()
    dist.barrier()
    if not is_main:
        result = fn()
    return result
