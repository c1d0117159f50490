"""The one device mesh of a run: ``("pp", "dp", "tp")``, pipeline outermost, tensor innermost.

Tensor parallelism is innermost so that its two all-reduces per layer and direction stay inside
a node (NVLink); pipeline parallelism is outermost because it only sends one activation per
micro-batch to the next stage. The sizes come from arguments or from the environment that
``accelerate launch`` sets (`ParallelDims.from_env`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ConfigError, EnvironmentSettingError

logger = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "tp")
DP_MODES = ("ddp", "fsdp")
PP_ENV = "TACO_PP_SIZE"
DP_MODE_ENV = "TACO_DP_MODE"
TIMEOUT_ENV = "TACO_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600  # a stalled peer fails the run in minutes, not torch's 30
_MAX_TIMEOUT_S = 1e9  # about 30 years: timedelta's range, and longer than any run


def collective_timeout(seconds: float | None = None) -> timedelta:
    """How long a collective waits for a peer before it fails: ``seconds``, else the
    ``TACO_TIMEOUT_S`` environment variable, else 10 minutes (long enough for a first step's
    compilation and a large checkpoint's write on a slow disk)."""
    if seconds is None:
        text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
        try:
            seconds = float(text)
        except ValueError:
            raise EnvironmentSettingError(
                f"{TIMEOUT_ENV}={text!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=1800 (30 minutes)"
            ) from None
        if not 0 < seconds < _MAX_TIMEOUT_S:
            raise EnvironmentSettingError(
                f"{TIMEOUT_ENV}={text!r}: the collective timeout must be a positive, finite number of seconds "
                f"below {_MAX_TIMEOUT_S:.0e}; set e.g. {TIMEOUT_ENV}=1800 (30 minutes)"
            )
    if not 0 < seconds < _MAX_TIMEOUT_S:
        raise ValueError(f"collective timeout {seconds!r} s must be > 0 and finite (set {TIMEOUT_ENV} or --timeout)")
    return timedelta(seconds=seconds)


USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"  # a launch config's parallelism_config block is on
LAUNCH_AXES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # the block's sizes, as ParallelismConfig names them
TP_ENV = "PARALLELISM_CONFIG_TP_SIZE"
SIZE_ENV = (PP_ENV, *(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE" for axis in LAUNCH_AXES))


def env_size(name: str, default: int | None = None) -> int | None:
    """The mesh size in environment variable ``name`` (``default`` when unset), or a
    `ConfigError` quoting it: a whole number >= 1."""
    text = os.environ.get(name)
    if text is None:
        return default
    value = text.strip()
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={text!r} is not a whole number >= 1: set it to a size such as {name}=2, or unset "
                          "it (in the accelerate config: parallelism_config's sizes)")
    return int(value)


def check_size_env() -> None:
    """A `ConfigError` for any mesh size in the environment that is not a whole number >= 1
    (before Accelerate's ``ParallelismConfig`` reads them with a bare ``int``)."""
    for name in SIZE_ENV:
        env_size(name)


@dataclass(frozen=True)
class LaunchSizes:
    """The sizes of an ``accelerate launch`` config's ``parallelism_config`` block, under the
    names of Accelerate's ``ParallelismConfig`` fields (read here: Accelerate 1.15's
    ``ParallelismConfig`` refuses tp with replicated dp as it reads them)."""

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1


def launch_sizes() -> LaunchSizes | None:
    """The sizes ``accelerate launch`` handed this process (``PARALLELISM_CONFIG_<AXIS>_SIZE``,
    each a whole number >= 1, else a `ConfigError` naming it), or None when its config has no
    ``parallelism_config`` block (``ACCELERATE_USE_PARALLELISM_CONFIG`` unset)."""
    check_size_env()
    if os.environ.get(USE_PARALLELISM_CONFIG, "false").lower() != "true":
        return None
    return LaunchSizes(**{f"{axis}_size": env_size(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", 1) for axis in LAUNCH_AXES})


def data_parallel_size(shard: int, replicate: int) -> tuple[int, str]:
    """The dp size and mode of Accelerate's ``dp_shard_size`` (FSDP2) and ``dp_replicate_size``
    (replicas averaging gradients); a ValueError when both exceed 1 (HSDP)."""
    if shard > 1 and replicate > 1:
        raise ValueError(f"dp_shard_size={shard} with dp_replicate_size={replicate} (HSDP) is not supported by "
                         "taco_accel; set one of them to 1")
    return shard * replicate, "fsdp" if shard > 1 else "ddp"


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel axes; their product is the world size.

    Args:
        pp: pipeline stages (outermost mesh axis). Default 1.
        dp: data-parallel replicas (middle axis). Default 1.
        tp: tensor-parallel ranks (innermost axis). Default 1.
        dp_mode: how the dp axis reduces gradients: ``"ddp"`` (default: every replica keeps
            all parameters, gradients are all-reduced) or ``"fsdp"`` (FSDP2: parameters,
            gradients and optimizer state are sharded over dp).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_mode: str = "ddp"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            _positive_int(f"ParallelDims.{name}", getattr(self, name))
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"ParallelDims.dp_mode={self.dp_mode!r} is not supported; use one of {DP_MODES}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a global rank (row-major over MESH_DIMS)."""
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} ({self.dp_mode}) x tp={self.tp}"

    @classmethod
    def from_env(cls, world_size: int | None = None, *, pp: int | None = None, dp: int | None = None,
                 tp: int | None = None, dp_mode: str | None = None) -> "ParallelDims":
        """Sizes from explicit values, else from the environment of ``accelerate launch``.

        tp comes from ``PARALLELISM_CONFIG_TP_SIZE``; dp from the launch config's block
        (`launch_sizes`: ``dp_shard_size`` for FSDP or ``dp_replicate_size`` for DDP); pp from
        ``TACO_PP_SIZE``.
        Accelerate's ParallelismConfig has no pipeline axis, so when pp is not given the
        processes that Accelerate's sizes leave unclaimed form the pipeline: a config with
        tp_size=4 on 8 processes runs pp=2. Any axis still unknown takes the remaining factor
        of the world size, dp first.
        """
        world_size = world_size or (dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1")))
        launch = launch_sizes()  # every size variable checked first
        if tp is None:
            tp = env_size(TP_ENV)
        if pp is None:
            pp = env_size(PP_ENV)
        if dp_mode is None:
            dp_mode = os.environ.get(DP_MODE_ENV)
        if dp is None and launch is not None:
            dp, launch_mode = data_parallel_size(launch.dp_shard_size, launch.dp_replicate_size)
            dp_mode = dp_mode or launch_mode
        tp = tp or 1
        if dp is None and pp is None:
            pp = 1
        if pp is None:
            pp, rest = divmod(world_size, dp * tp)
            if rest or pp < 1:
                raise ConfigError(f"dp={dp} x tp={tp} does not divide the world size {world_size}: choose sizes whose "
                                  "product divides the number of processes (--tp/--dp/--pp, or the launch config's "
                                  "parallelism_config)")
            if pp > 1:
                logger.info("the parallelism config covers %d of %d processes: pp=%d takes the rest", dp * tp, world_size, pp)
        if dp is None:
            dp, rest = divmod(world_size, pp * tp)
            if rest or dp < 1:
                raise ConfigError(f"pp={pp} x tp={tp} does not divide the world size {world_size}: choose sizes whose "
                                  "product divides the number of processes (--tp/--dp/--pp, or the launch config's "
                                  "parallelism_config)")
        dims = cls(pp=pp, dp=dp, tp=tp, dp_mode=dp_mode or "ddp")
        if dims.world_size != world_size:
            raise ValueError(
                f"{dims} needs {dims.world_size} processes but the world size is {world_size}; "
                "change --pp/--dp/--tp (or TACO_PP_SIZE / the accelerate config) to multiply to it"
            )
        return dims


def build_mesh(dims: ParallelDims, device_type: str | None = None, timeout: timedelta | None = None) -> DeviceMesh:
    """The ``("pp", "dp", "tp")`` DeviceMesh over all ranks (a collective: call it on every rank).

    Initialises the default process group (NCCL with GPUs, gloo without) when needed. Every
    group of the mesh fails a collective that waits longer than ``timeout`` (default:
    `collective_timeout`) instead of hanging.
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    timeout = timeout or collective_timeout()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        if dims.world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, timeout=timeout)
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"{dims} needs {dims.world_size} processes; this run has {dist.get_world_size()}")
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options())
    options._timeout = timeout
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_DIMS,
                            backend_override={name: (backend, options) for name in MESH_DIMS})
    logger.info("device mesh %s on %d %s process(es)", dims, dims.world_size, device_type)
    _destroy_groups_at_clean_exit()
    return mesh


_exit_hook = False


def _destroy_groups_at_clean_exit() -> None:
    """Destroy the process groups when the interpreter exits normally, if the script has not.

    Scripts often end without ``destroy_process_group`` (or Accelerate's ``end_training``). Gloo
    then frees its groups during interpreter teardown, where the tensors its worker threads still
    hold from their last collectives cannot be released (that needs the interpreter): the process
    aborts after its work is done ("terminate called without an active exception", exit -6) and
    the launcher reports the run as failed. Destroying the groups while the interpreter is alive
    avoids it. Not after an uncaught exception: peers may still be inside a collective with this
    rank, and tearing a group down under them could block; the launcher ends such a run anyway.
    """
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_destroy_if_clean)


def _destroy_if_clean() -> None:
    if getattr(sys, "last_value", None) is not None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 - exiting anyway; say why the groups stayed
        logger.debug("process groups left to the interpreter's exit: %s", error)


def pp_pair_groups(mesh: DeviceMesh, pairs) -> dict[frozenset, object]:
    """For each pair ``(p, q)`` of pp ranks (p != q), the process group of this rank's (dp, tp)
    coordinate at pp ranks p and q, keyed ``frozenset((p, q))``; only the pairs holding this rank.
    The pp group itself when pp = 2; otherwise new groups of two ranks, one per (dp, tp)
    coordinate (a collective on every rank: each group is created everywhere, in one order)."""
    pp = mesh["pp"].size()
    pairs = sorted({tuple(sorted(pair)) for pair in pairs if pair[0] != pair[1]})
    if pp == 2:
        return {frozenset(pair): mesh["pp"].get_group() for pair in pairs}
    ranks, rank, groups = mesh.mesh, dist.get_rank(), {}
    for p, q in pairs:
        for d in range(ranks.shape[1]):
            for t in range(ranks.shape[2]):
                pair = sorted((int(ranks[p, d, t]), int(ranks[q, d, t])))
                group = dist.new_group(pair, timeout=collective_timeout())
                if rank in pair:
                    groups[frozenset((p, q))] = group
    return groups


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
