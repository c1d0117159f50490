"""GPT-2: fused ``Conv1D`` q|k|v (``c_attn``, weight [in, 3*embed]), learned positions, LayerNorm.

``c_attn`` is split as three blocks of heads, so rank r holds q, k and v of its own heads
(``Colwise(heads="q", fused=3)``); the attention splits its output with ``split_size``, set
to the local width. Conv1D weights keep their [in, out] layout. Position embeddings stay
replicated; the lm head is tied to ``wte`` and split the same way.
"""

from __future__ import annotations

from torch import nn
from transformers import GPT2Config

from .plan import AttentionDims, Colwise, EnterRegion, Rowwise, TPPlan, register_plan


def attention_dims(config) -> AttentionDims:
    return AttentionDims(config.n_head, config.n_head, config.n_embd // config.n_head)


def set_local_heads(attention: nn.Module, q_heads: int, kv_heads: int) -> None:
    attention.num_heads = q_heads
    attention.split_size = attention.embed_dim = q_heads * attention.head_dim


def check(config) -> None:
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "GPT-2 with add_cross_attention=True is not supported by the gpt2 plan; use a decoder-only config"
        )


GPT2_PLAN = register_plan(
    TPPlan(
        name="gpt2",
        model_types=("gpt2",),
        embedding="transformer.wte",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        layer={
            "attn": EnterRegion(),
            "attn.c_attn": Colwise(heads="q", fused=3),
            "attn.c_proj": Rowwise(),
            "mlp": EnterRegion(),
            "mlp.c_fc": Colwise(),
            "mlp.c_proj": Rowwise(),
        },
        attention="attn",
        dims=attention_dims,
        set_local_heads=set_local_heads,
        check=check,
        position_embedding="transformer.wpe",
        embedding_dropout="transformer.drop",
        tiny={"gpt2": (GPT2Config, dict(  # fused Conv1D c_attn, learned positions, tied, an odd vocabulary
            vocab_size=130, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        ))},
    )
)
