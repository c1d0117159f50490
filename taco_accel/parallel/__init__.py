"""Layer 5: the device mesh and the parallelisms that compose with tensor parallelism.

Each parallelism is one pass over a plain transformers model, torchtitan style, taking plain
values and a ("pp", "dp", "tp") DeviceMesh: `apply_tp` (`taco_accel.parallelize` over the tp
axis), `apply_pp` (split into stages, whose boundaries go through the codec), `apply_dp` (DDP or
FSDP2 over dp), then `apply_compile`. `distribute` runs them in order and returns the `ModelParts` of this rank: its
modules, and the gradient reductions and clipping over the whole mesh that end a step;
`export_pretrained` gathers them into one transformers checkpoint.
"""

from .compile import (apply_compile, compile_backend, enable_activation_checkpointing, has_decoder_layers, is_checkpointed,
                      is_compiled)
from .boundary import Boundary, BoundaryStage, PipelineBoundaries, boundary_name
from .data_parallel import DataParallelGradSync, ReplicaGradSum, TiedEmbeddingSync, apply_dp, local_tensor
from .export import export_pretrained, gather_full_state_dict
from .mesh import MESH_DIMS, ParallelDims, build_mesh, collective_timeout
from .parts import ModelParts, clip_grad_norm_, distribute
from .pipeline import (SCHEDULES, PipelinePlan, apply_pp, build_schedule, emulate_boundaries, make_pipeline_stages,
                       prune_to_stage, split_layers)
from .stage import StageModule, decoder_layers, site_tables
from .tensor_parallel import apply_tp, check_parallelized

__all__ = [
    "Boundary",
    "BoundaryStage",
    "DataParallelGradSync",
    "MESH_DIMS",
    "ModelParts",
    "ParallelDims",
    "PipelineBoundaries",
    "PipelinePlan",
    "ReplicaGradSum",
    "SCHEDULES",
    "StageModule",
    "TiedEmbeddingSync",
    "apply_compile",
    "apply_dp",
    "apply_pp",
    "apply_tp",
    "boundary_name",
    "build_mesh",
    "build_schedule",
    "check_parallelized",
    "clip_grad_norm_",
    "collective_timeout",
    "compile_backend",
    "decoder_layers",
    "distribute",
    "emulate_boundaries",
    "enable_activation_checkpointing",
    "export_pretrained",
    "gather_full_state_dict",
    "has_decoder_layers",
    "is_checkpointed",
    "is_compiled",
    "local_tensor",
    "make_pipeline_stages",
    "prune_to_stage",
    "site_tables",
    "split_layers",
]
