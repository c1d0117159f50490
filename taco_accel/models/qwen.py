"""Qwen2 / Qwen2.5 and Qwen3: the Llama layout, with q/k/v biases (Qwen2) or per-head RMSNorms
``q_norm`` / ``k_norm`` (Qwen3).

Nothing in the plan changes for either: biases of column-parallel layers are split with their
outputs, and ``q_norm`` / ``k_norm`` act on one head at a time, so they run unchanged on the
local heads; their weights stay replicated and `parallelize` sums their gradients over the ranks
(each rank sees only its heads).
"""

from __future__ import annotations

from dataclasses import replace

from .llama import LLAMA_PLAN
from .plan import register_plan

QWEN2_PLAN = register_plan(replace(LLAMA_PLAN, name="qwen2", model_types=("qwen2",)))
QWEN3_PLAN = register_plan(replace(LLAMA_PLAN, name="qwen3", model_types=("qwen3",)))
