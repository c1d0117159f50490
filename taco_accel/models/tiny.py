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


def tiny_config(model_type: str, **overrides):
    """A 2-layer, 64-wide config of ``model_type`` (qwen2, qwen3, llama, mistral, gpt2)."""
    if model_type == "qwen2":  # q/k/v biases, tied embeddings, 2 kv heads
        config = Qwen2Config(vocab_size=128, num_key_value_heads=2, tie_word_embeddings=True, **COMMON)
    elif model_type == "qwen3":  # q_norm / k_norm, explicit head_dim, attention biases, untied
        config = Qwen3Config(
            vocab_size=128, num_key_value_heads=2, head_dim=32, attention_bias=True,
            tie_word_embeddings=False, **COMMON,
        )
    elif model_type == "llama":  # one kv head (replicated on every rank), MLP biases
        config = LlamaConfig(vocab_size=128, num_key_value_heads=1, mlp_bias=True, **COMMON)
    elif model_type == "mistral":  # a vocabulary of 130: uneven vocab-parallel slices
        config = MistralConfig(vocab_size=130, num_key_value_heads=4, **COMMON)
    elif model_type == "gpt2":  # fused Conv1D c_attn, learned positions, tied embeddings
        config = GPT2Config(
            vocab_size=130, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    else:
        raise ValueError(f"no tiny config for {model_type!r}; use one of qwen2, qwen3, llama, mistral, gpt2")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny causal LM with weights drawn from ``seed`` (the same on every rank)."""
    import torch

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
