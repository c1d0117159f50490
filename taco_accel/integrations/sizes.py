"""The mesh a `taco_accel.Accelerator` runs on: its sizes, the ``ParallelismConfig`` that
describes it to the libraries built on Accelerate, and how long its collectives wait.

- `mesh_sizes`: the ``("pp", "dp", "tp")`` sizes from taco_accel's own `ParallelDims`, else
  Accelerate's ``ParallelismConfig`` or a launch's `LaunchSizes` (`dims_from_config`, by
  Accelerate's own rules), with one process asking for tp > 1 left to emulated TP;
- `describe`: Accelerate's ``ParallelismConfig`` of the data-parallel replicas (what transformers'
  Trainer and TRL divide their counts by; Accelerate builds nothing from it);
- `with_timeout`: the collective timeout, the same for Accelerate's world group and the mesh's.
"""

from __future__ import annotations

import logging
import os

from ..parallel import ParallelDims, collective_timeout
from ..parallel.mesh import PP_ENV, data_parallel_size

logger = logging.getLogger(__name__)


def mesh_sizes(parallel_dims: ParallelDims | None, config, pp: int | None, world: int) -> tuple[ParallelDims, int]:
    """The mesh's sizes and the emulated tp degree (1: none): ``parallel_dims`` if given, else
    `dims_from_config`. One process asking for tp > 1 (no pp, no dp) gets a one-process mesh
    and emulates the tp degree (a warning says so)."""
    requested = parallel_dims or dims_from_config(config, pp, world)
    if requested.world_size > 1 and world == 1 and requested.pp == requested.dp == 1:
        logger.warning("one process: tensor parallelism tp=%d is emulated in this process (the numerics of "
                       "TACO-compressed TP, not its speed); launch %d processes for real TP",
                       requested.tp, requested.tp)
        return ParallelDims(dp_mode=requested.dp_mode), requested.tp
    return requested, 1


def dims_from_config(config, pp: int | None, world: int) -> ParallelDims:
    """Mesh sizes from Accelerate's ``ParallelismConfig`` or a launch's `LaunchSizes` (or none:
    data parallelism over all).

    As Accelerate's ``ParallelismConfig._validate_accelerator``: all sizes 1 means data
    parallelism over every process; otherwise the sizes must multiply to the number of
    processes (a ValueError naming them), unless pipeline stages are asked for (``pp`` or
    ``TACO_PP_SIZE``), which then take the remaining factor. One process with ``tp_size > 1``
    is left to emulation.
    """
    if config is None:
        return ParallelDims.from_env(world, pp=pp, tp=1)
    if config.cp_size > 1 or config.sp_size > 1:
        raise ValueError(
            f"parallelism_config cp_size={config.cp_size} / sp_size={config.sp_size}: context and Ulysses sequence "
            "parallelism are not supported with TACO TP; set them to 1 (Megatron sequence parallelism inside TP is "
            "Accelerator(sequence_parallel=True))"
        )
    shard, replicate = config.dp_shard_size, config.dp_replicate_size
    dp, mode = data_parallel_size(shard, replicate)
    if world == 1:
        return ParallelDims(pp=pp or 1, dp=dp, tp=config.tp_size, dp_mode=mode)
    total = dp * config.tp_size
    if total == 1:  # Accelerate: replicas over every process (over those of a stage with pipelining)
        stages = pp or int(os.environ.get(PP_ENV, "1"))
        return ParallelDims.from_env(world, pp=stages, dp=max(world // stages, 1), tp=1, dp_mode=mode)
    if pp is None and PP_ENV not in os.environ:
        if total != world:
            raise ValueError(
                f"ParallelismConfig total_size ({total}) does not match num_processes ({world}) (dp_replicate_size="
                f"{replicate} x dp_shard_size={shard} x tp_size={config.tp_size}). Please adjust dp_replicate_size/"
                f"dp_shard_size/tp_size to multiply to {world}, or ask for pipeline stages with "
                f"Accelerator(pp_size=...) or {PP_ENV}"
            )
    return ParallelDims.from_env(world, pp=pp, dp=dp, tp=config.tp_size, dp_mode=mode)


def describe(dims: ParallelDims):
    """Accelerate's ``ParallelismConfig`` of the data-parallel replicas of ``dims`` (FSDP2 shards or
    DDP replicas), the processes an accelerator's ``num_processes`` counts: ``total_size`` is
    ``dims.dp``, and tp is 1 (a replica's tensor- and pipeline-parallel ranks count once), so that
    the libraries that divide by its tp size where processes share a batch (transformers' Trainer,
    TRL) divide counts over the replicas by 1. Every size explicit: no environment is read."""
    from accelerate import ParallelismConfig

    fsdp = dims.dp_mode == "fsdp"
    return ParallelismConfig(dp_replicate_size=1 if fsdp else dims.dp, dp_shard_size=dims.dp if fsdp else 1,
                             tp_size=1, cp_size=1, cp_backend="torch", sp_size=1, sp_backend="deepspeed")


def with_timeout(kwargs: dict):
    """The collective timeout: an ``InitProcessGroupKwargs(timeout=...)`` handler's, else
    `collective_timeout` (``TACO_TIMEOUT_S``, 10 minutes), added to ``kwargs`` (an Accelerator's)
    as such a handler so that the world group Accelerate creates waits no longer than the mesh's
    groups."""
    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(kwargs.get("kwargs_handlers") or [])
    given = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
    if given is not None and given.timeout is not None:
        return given.timeout
    timeout = collective_timeout()
    if given is None:
        handlers.append(InitProcessGroupKwargs(timeout=timeout))
    else:
        given.timeout = timeout
    kwargs["kwargs_handlers"] = handlers
    return timeout
