"""Tiny configs of every supported family, for tests and examples (no hub access needed).

Each one exercises the family's awkward parts: grouped-query attention with fewer kv heads than
ranks (replicated), biases on column and row layers, tied and untied embeddings, and a
vocabulary that does not divide by 4.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
)


BASES = {  # model_type: (config class, its tiny settings)
    "qwen2": (Qwen2Config, dict(vocab_size=128, num_key_value_heads=2, tie_word_embeddings=True, **COMMON)),
    "qwen3": (Qwen3Config, dict(
        vocab_size=128, num_key_value_heads=2, head_dim=32, attention_bias=True, tie_word_embeddings=False, **COMMON
    )),
    "llama": (LlamaConfig, dict(vocab_size=128, num_key_value_heads=1, mlp_bias=True, **COMMON)),
    "mistral": (MistralConfig, dict(vocab_size=130, num_key_value_heads=4, **COMMON)),
    "gpt2": (GPT2Config, dict(
        vocab_size=130, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )),
}


def tiny_config(model_type: str, **overrides):
    """A 2-layer, 64-wide config of ``model_type`` (qwen2, qwen3, llama, mistral, gpt2).

    qwen2: q/k/v biases, tied embeddings, 2 kv heads; qwen3: q_norm / k_norm, explicit
    head_dim, attention biases, untied; llama: one kv head (replicated on every rank), MLP
    biases; mistral: a vocabulary of 130 (uneven vocab-parallel slices); gpt2: fused Conv1D
    c_attn, learned positions, tied embeddings. ``overrides`` go to the config's constructor,
    so that derived fields follow (``head_dim`` from ``hidden_size`` and the head count); a
    name the config does not have raises instead of being stored unused.
    """
    if model_type not in BASES:
        raise ValueError(f"no tiny config for {model_type!r}; use one of {', '.join(BASES)}")
    cls, settings = BASES[model_type]
    base = cls(**settings)
    unknown = sorted(k for k in overrides if not hasattr(base, k))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {unknown}; check the spelling (e.g. num_key_value_heads)")
    names = {base.attribute_map.get(k, k) for k in overrides}  # gpt2: max_position_embeddings is n_positions
    return cls(**{k: v for k, v in settings.items() if k not in names}, **overrides)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny causal LM with weights drawn from ``seed`` (the same on every rank)."""
    import torch

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
