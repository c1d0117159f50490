"""Tiny models of every registered family, for tests and examples (no hub access needed).

The configs live with their family's plan (`TPPlan.tiny`); each exercises the family's awkward
parts: grouped-query attention with fewer kv heads than ranks (replicated), biases on column
and row layers, tied and untied embeddings, and a vocabulary that does not divide by 4.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from .plan import plan_of_type, supported_model_types


def tiny_model_types() -> list[str]:
    """Every registered model type that has a tiny config (every built-in one)."""
    return [t for t in supported_model_types() if t in plan_of_type(t).tiny]


def tiny_config(model_type: str, **overrides):
    """A 2-layer, 64-wide config of ``model_type`` (qwen2, qwen3, llama, mistral, gpt2).

    qwen2: q/k/v biases, tied embeddings, 2 kv heads; qwen3: q_norm / k_norm, explicit
    head_dim, attention biases, untied; llama: one kv head (replicated on every rank), MLP
    biases; mistral: a vocabulary of 130 (uneven vocab-parallel slices); gpt2: fused Conv1D
    c_attn, learned positions, tied embeddings. ``overrides`` go to the config's constructor,
    so that derived fields follow (``head_dim`` from ``hidden_size`` and the head count); a
    name the config does not have raises instead of being stored unused.
    """
    plan = plan_of_type(model_type)
    if plan is None or model_type not in plan.tiny:
        raise ValueError(f"no tiny config for {model_type!r}; use one of {', '.join(tiny_model_types())}")
    cls, settings = plan.tiny[model_type]
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
