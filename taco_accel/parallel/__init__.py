"""Layer 5: the device mesh and the parallelisms that compose with tensor parallelism.

Each parallelism is one pass over a plain transformers model, torchtitan style, taking plain
values and a ("pp", "dp", "tp") DeviceMesh: `apply_pp` (split into stages), `apply_tp`
(`taco_accel.parallelize` on each stage), `apply_dp` (DDP or FSDP2 over dp). Plus what spans
the whole mesh: `clip_grad_norm_` and `TiedEmbeddingSync`.
"""

from .data_parallel import DataParallelGradSync, ReplicaGradSum, TiedEmbeddingSync, apply_dp, clip_grad_norm_, grad_norm_sq
from .mesh import MESH_DIMS, ParallelDims, build_mesh, default_device
from .pipeline import SCHEDULES, PipelinePlan, apply_pp, build_schedule, make_pipeline_stages, prune_to_stage, split_layers
from .stage import StageModule, cross_entropy
from .tensor_parallel import apply_tp

__all__ = [
    "DataParallelGradSync",
    "ReplicaGradSum",
    "MESH_DIMS",
    "SCHEDULES",
    "ParallelDims",
    "PipelinePlan",
    "StageModule",
    "TiedEmbeddingSync",
    "apply_dp",
    "apply_pp",
    "apply_tp",
    "build_mesh",
    "build_schedule",
    "clip_grad_norm_",
    "cross_entropy",
    "default_device",
    "grad_norm_sq",
    "make_pipeline_stages",
    "prune_to_stage",
    "split_layers",
]
