"""Model size presets of the recipes, as transformers config keyword arguments.

``vocab_size`` and the maximum sequence length are filled in from the tokenizer and the run
(`model_config`). "nano" is for the test suite, "tiny" trains in about a minute on 2 CPU
processes; the others are the usual shapes up to 7B-class for GPUs (qwen2 0.5b, 1.5b and 3b: Qwen2.5's, whose
vocabulary is 151,936).
"""

from __future__ import annotations

QWEN = {
    "nano": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
}

GPT = {
    "nano": dict(n_embd=32, n_layer=4, n_head=4),
    "tiny": dict(n_embd=128, n_layer=4, n_head=4),
    "124m": dict(n_embd=768, n_layer=12, n_head=12),
    "350m": dict(n_embd=1024, n_layer=24, n_head=16),
    "774m": dict(n_embd=1280, n_layer=36, n_head=20),
    "1.5b": dict(n_embd=1600, n_layer=48, n_head=25),
    "6.7b": dict(n_embd=4096, n_layer=32, n_head=32),
}

FAMILY_PRESETS = {"qwen2": QWEN, "gpt2": GPT}


def pad_vocab(n: int, multiple: int = 128) -> int:
    """Vocabulary rounded up (Megatron's make-vocab-size-divisible-by), so every tp divides it."""
    return -(-n // multiple) * multiple


def model_config(family: str, preset: str, *, vocab_size: int, max_positions: int, **overrides):
    """A transformers config of ``family`` ("qwen2" or "gpt2") at size ``preset``; ``overrides``
    (any config field, ``vocab_size`` included: e.g. Qwen2.5's 151,936) win."""
    presets = FAMILY_PRESETS.get(family)
    if presets is None:
        raise ValueError(f"model family {family!r} has no presets; use one of {sorted(FAMILY_PRESETS)}")
    if preset not in presets:
        raise ValueError(f"{family} preset {preset!r} is unknown; use one of {list(presets)}")
    values = dict(presets[preset])
    if family == "qwen2":
        from transformers import Qwen2Config

        values.setdefault("tie_word_embeddings", False)
        values.update(vocab_size=vocab_size, max_position_embeddings=max(max_positions, 128))
        return Qwen2Config(**{**values, **overrides})
    from transformers import GPT2Config

    values.update(vocab_size=vocab_size, n_positions=max(max_positions, 128), resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**values, **overrides})
