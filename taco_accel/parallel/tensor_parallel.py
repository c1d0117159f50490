"""Tensor parallelism as one pass over a (stage of a) model: `taco_accel.parallelize` on the
mesh's tp axis, plus the bookkeeping the other passes need (which parameters are sharded)."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..models import parallelize
from ..comm.policy import DEFAULT_COMPRESSION, Compression
from ..models.state import tp_replicas

logger = logging.getLogger(__name__)


def apply_tp(model: nn.Module, mesh: DeviceMesh, compression=DEFAULT_COMPRESSION, sequence_parallel: bool = False,
             logits: str = "full") -> dict[str, int]:
    """Rewrite ``model`` in place for TP over ``mesh["tp"]``; return ``{name: replicas}``: how
    many tp ranks hold each parameter's local values (tp for a replicated parameter, 1 for a
    plain shard, in between for e.g. kv heads replicated over fewer ranks than tp), measured
    from the sizes before and after. Norms over the mesh divide by it.

    ``compression``: anything `Compression.resolve` takes (default ``"auto"``; ``"off"`` or
    None: plain TP); ``logits``: `parallelize`'s. tp=1 leaves the model as is (`distribute` installs
    its head and loss).
    """
    compression = Compression.resolve(compression)
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    if tp == 1:
        return {n: 1 for n, _ in model.named_parameters()}
    parallelize(model, tp=tp, compression=compression, sequence_parallel=sequence_parallel,
                device_mesh=tp_mesh, logits=logits)
    replicas = tp_replicas(model, tp)
    logger.info(
        "applied tensor parallelism: tp=%d, %d of %d parameters sharded, compression %s",
        tp, sum(r < tp for r in replicas.values()), len(replicas), compression,
    )
    return replicas


def check_parallelized(model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise a ValueError unless ``model`` (already given to `taco_accel.parallelize`) is tensor
    parallel over exactly the ranks of ``mesh["tp"]`` (an emulated model: over a tp of 1)."""
    import torch.distributed as dist

    ctx, tp_mesh = model.taco, mesh["tp"]
    if ctx.emulated:
        if tp_mesh.size() != 1:
            raise ValueError(f"the model emulates tp={ctx.tp} in one process but the mesh has tp={tp_mesh.size()}; "
                             "parallelize it with device_mesh=mesh['tp'] instead of emulate=True")
        return
    mine = dist.get_process_group_ranks(ctx.group) if ctx.group is not None else [dist.get_rank()]
    expected = dist.get_process_group_ranks(tp_mesh.get_group())
    if ctx.tp != tp_mesh.size() or sorted(mine) != sorted(expected):
        raise ValueError(
            f"the model was parallelized with tp={ctx.tp} over ranks {sorted(mine)}, but the mesh's tensor-parallel "
            f"group is tp={tp_mesh.size()} over ranks {sorted(expected)}: set the tp size in the parallelism config "
            f"(parallelism_config_tp_size / ParallelismConfig(tp_size={ctx.tp})), or pass the model to prepare() "
            "before parallelizing it (prepare parallelizes it over the mesh)"
        )
