"""Qwen2 / Qwen2.5 and Qwen3: the Llama layout, with q/k/v biases (Qwen2) or per-head RMSNorms
``q_norm`` / ``k_norm`` (Qwen3).

Nothing in the plan changes for either: biases of column-parallel layers are split with their
outputs, and ``q_norm`` / ``k_norm`` act on one head at a time, so they run unchanged on the
local heads; their weights stay replicated and `parallelize` sums their gradients over the ranks
(each rank sees only its heads).
"""

from __future__ import annotations

from dataclasses import replace

from transformers import Qwen2Config, Qwen3Config

from .llama import LLAMA_PLAN, TINY
from .plan import register_plan

QWEN2_PLAN = register_plan(replace(LLAMA_PLAN, name="qwen2", model_types=("qwen2",), tiny={
    # q/k/v biases, tied embeddings, 2 kv heads
    "qwen2": (Qwen2Config, dict(vocab_size=128, num_key_value_heads=2, tie_word_embeddings=True, **TINY)),
}))
QWEN3_PLAN = register_plan(replace(LLAMA_PLAN, name="qwen3", model_types=("qwen3",), tiny={
    # q_norm / k_norm, a head_dim apart from hidden / heads, attention biases, untied
    "qwen3": (Qwen3Config, dict(vocab_size=128, num_key_value_heads=2, head_dim=32, attention_bias=True,
                                tie_word_embeddings=False, **TINY)),
}))
