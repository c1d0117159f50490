"""Llama-like decoders (Llama, Mistral): separate q/k/v/o projections, a gated MLP, RMSNorm.

The attention forward reshapes with ``-1`` heads, so local head counts only change
``num_key_value_groups`` (and ``num_heads`` / ``num_key_value_heads`` where an older
transformers keeps them). Grouped-query attention with fewer kv heads than ranks replicates
each kv head on ``tp / num_key_value_heads`` ranks, as Megatron does.
"""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig, MistralConfig

from .plan import AttentionDims, Colwise, EnterRegion, Rowwise, TPPlan, register_plan

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)  # the tiny decoders' shared shape (4 heads: tp up to 4)

DECODER_LAYER = {
    "self_attn": EnterRegion(),
    "self_attn.q_proj": Colwise(heads="q"),
    "self_attn.k_proj": Colwise(heads="kv"),
    "self_attn.v_proj": Colwise(heads="kv"),
    "self_attn.o_proj": Rowwise(),
    "mlp": EnterRegion(),
    "mlp.gate_proj": Colwise(),
    "mlp.up_proj": Colwise(),
    "mlp.down_proj": Rowwise(),
}


def attention_dims(config) -> AttentionDims:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionDims(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim)


def set_local_heads(attention: nn.Module, q_heads: int, kv_heads: int) -> None:
    attention.num_key_value_groups = q_heads // kv_heads
    for name, value in (("num_heads", q_heads), ("num_key_value_heads", kv_heads)):
        if hasattr(attention, name):
            setattr(attention, name, value)


LLAMA_PLAN = register_plan(
    TPPlan(
        name="llama",
        model_types=("llama", "mistral"),
        embedding="model.embed_tokens",
        layers="model.layers",
        final_norm="model.norm",
        layer=DECODER_LAYER,
        attention="self_attn",
        dims=attention_dims,
        set_local_heads=set_local_heads,
        rotary="model.rotary_emb",
        tiny={  # llama: one kv head (replicated on every rank), MLP biases; mistral: an odd vocabulary
            "llama": (LlamaConfig, dict(vocab_size=128, num_key_value_heads=1, mlp_bias=True, **TINY)),
            "mistral": (MistralConfig, dict(vocab_size=130, num_key_value_heads=4, **TINY)),
        },
    )
)
