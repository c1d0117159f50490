"""Tensor parallelism as one pass over a (stage of a) model: `taco_accel.parallelize` on the
mesh's tp axis, plus the bookkeeping the other passes need (which parameters are sharded)."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..codec import TacoConfig

logger = logging.getLogger(__name__)


def apply_tp(model: nn.Module, mesh: DeviceMesh, compression: TacoConfig | None = None,
             sequence_parallel: bool = False) -> dict[str, int]:
    """Rewrite ``model`` in place for TP over ``mesh["tp"]``; return ``{name: replicas}``: how
    many tp ranks hold each parameter's local values (tp for a replicated parameter, 1 for a
    plain shard, in between for e.g. kv heads replicated over fewer ranks than tp), measured
    from the sizes before and after. Norms over the mesh divide by it.

    ``compression=None`` runs the TP collectives uncompressed. tp=1 leaves the model as is.
    """
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    if tp == 1:
        return {n: 1 for n, _ in model.named_parameters()}
    try:
        from ..models import parallelize
        from ..models.checkpoint import tp_replicas
    except ImportError as e:  # pragma: no cover - only while taco_accel.models is missing
        raise RuntimeError(f"tp={tp_mesh.size()} needs taco_accel.models.parallelize ({e})") from e
    parallelize(model, tp=tp, compression=compression, sequence_parallel=sequence_parallel,
                device_mesh=tp_mesh)
    replicas = tp_replicas(model, tp)
    logger.info(
        "applied tensor parallelism: tp=%d, %d of %d parameters sharded, compression %s",
        tp, sum(r < tp for r in replicas.values()), len(replicas), "off" if compression is None else compression,
    )
    return replicas
