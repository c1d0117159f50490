"""Layer 4: per-architecture tensor-parallel plans, `parallelize`, and TP-aware checkpoints."""

from . import gpt2, llama, qwen  # noqa: F401  (the built-in families register their plans)
from .pretrained import from_pretrained
from .state import gather_state_dict, save_pretrained
from .context import TPContext, context_of
from .parallelize import calibrate_group_sizes, parallelize
from .plan import (
    AttentionDims, Colwise, EnterRegion, Rowwise, TPPlan, plan_for, plan_of_type, register_plan, supported_model_types,
)

__all__ = [
    "AttentionDims",
    "Colwise",
    "EnterRegion",
    "Rowwise",
    "TPContext",
    "TPPlan",
    "calibrate_group_sizes",
    "context_of",
    "from_pretrained",
    "gather_state_dict",
    "parallelize",
    "plan_for",
    "plan_of_type",
    "register_plan",
    "save_pretrained",
    "supported_model_types",
]
