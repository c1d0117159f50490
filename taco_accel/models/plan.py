"""Declarative tensor-parallel plans, one per architecture family, and their registry.

A `TPPlan` names transformers modules and says what each becomes, in the style of torchtitan
and of transformers' own ``base_model_tp_plan``::

    layer={
        "self_attn": EnterRegion(),            # f (or the sequence all-gather) once, for q/k/v
        "self_attn.q_proj": Colwise(heads="q"),
        "self_attn.k_proj": Colwise(heads="kv"),
        "self_attn.v_proj": Colwise(heads="kv"),
        "self_attn.o_proj": Rowwise(),         # g (or the sequence reduce-scatter)
        ...
    }

A plan is everything taco_accel knows about a family, so adding an architecture is one file
like `taco_accel.models.llama`: the module names (which also lay out pipeline stages), how to
read the head counts from the config, which attributes hold the local head counts, and a tiny
config per model type (the tests run every registered family through the same parity suite);
then ``register_plan(plan)``. Parameter names stay transformers' own, so checkpoints and the
vocab-parallel loss need nothing per family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn


@dataclass(frozen=True)
class EnterRegion:
    """Enter the TP region once at this module's ``hidden_states`` input: the column-parallel
    layers inside it share one collective (f, or the all-gather with sequence parallelism)."""


@dataclass(frozen=True)
class Colwise:
    """Column-parallel linear: split the output features.

    ``heads``: the outputs are whole attention heads, ``"q"`` (split evenly) or ``"kv"``
    (grouped-query attention: replicated when there are fewer kv heads than ranks).
    ``fused``: the output is this many equal blocks of heads, each split on its own (GPT-2's
    ``c_attn`` = q|k|v is ``Colwise(heads="q", fused=3)``).
    """

    heads: Literal["q", "kv"] | None = None
    fused: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear: split the input features; the outputs are summed over the ranks."""


Style = EnterRegion | Colwise | Rowwise


@dataclass(frozen=True)
class AttentionDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class TPPlan:
    """How the causal LMs of one architecture family become tensor parallel.

    Module names are relative to the causal-LM model (``embedding``, ``layers``,
    ``final_norm``, ``lm_head``) or to one decoder layer (``layer``, ``attention``).

    Args:
        name: family name, for messages.
        model_types: the ``config.model_type`` values this plan serves.
        embedding / layers / final_norm / lm_head: module names.
        layer: ``{module name in a layer: style}``.
        attention: the attention module whose head counts become local.
        dims: reads `AttentionDims` from the model config.
        set_local_heads: ``(attention module, local q heads, local kv heads)``: updates the
            attributes the attention forward reads (e.g. ``num_key_value_groups``).
        check: optional ``(config) -> None`` raising ValueError for unsupported settings.
        position_embedding / embedding_dropout / rotary: what a pipeline stage runs besides
            the layers (`taco_accel.parallel.StageModule`): learned positions added to the
            token embedding, the dropout after it, the rotary module whose output every layer
            takes. All module names share the decoder model's prefix (``model.``).
        tiny: ``{model_type: (config class, settings)}``: a small config of each model type
            the plan serves, with the family's awkward parts (`taco_accel.models.tiny`).
    """

    name: str
    model_types: tuple[str, ...]
    embedding: str
    layers: str
    final_norm: str
    layer: Mapping[str, Style]
    attention: str
    dims: Callable[[object], AttentionDims]
    set_local_heads: Callable[[nn.Module, int, int], None]
    lm_head: str = "lm_head"
    check: Callable[[object], None] | None = field(default=None)
    position_embedding: str | None = None
    embedding_dropout: str | None = None
    rotary: str | None = None
    tiny: Mapping[str, tuple[type, dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = self.base + "."
        named = [self.embedding, self.layers, self.final_norm, self.position_embedding, self.embedding_dropout,
                 self.rotary]
        if any(name is not None and not name.startswith(base) for name in named):
            raise ValueError(f"plan {self.name!r}: every module name must start with the decoder model's "
                             f"{base!r} (got {named})")
        missing = set(self.tiny) - set(self.model_types)
        if missing:
            raise ValueError(f"plan {self.name!r}: tiny configs for {sorted(missing)}, not in model_types")

    @property
    def base(self) -> str:
        """The decoder model inside the causal LM (``model``, ``transformer``)."""
        return self.embedding.split(".")[0]


_PLANS: dict[str, TPPlan] = {}


def register_plan(plan: TPPlan, overwrite: bool = False) -> TPPlan:
    """Make ``plan`` serve its ``model_types``; returns it (usable as a decorator target)."""
    for model_type in plan.model_types:
        if model_type in _PLANS and not overwrite:
            raise ValueError(
                f"model_type {model_type!r} already has the plan {_PLANS[model_type].name!r}; "
                "pass overwrite=True to replace it"
            )
        _PLANS[model_type] = plan
    return plan


def supported_model_types() -> list[str]:
    return sorted(_PLANS)


def plan_of_type(model_type: str) -> TPPlan | None:
    """The registered plan of a ``config.model_type``, or None."""
    return _PLANS.get(model_type)


def plan_for(model: nn.Module) -> TPPlan:
    """The plan for a transformers causal LM, or a ValueError naming the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    plan = _PLANS.get(model_type)
    if plan is None:
        raise ValueError(
            f"taco_accel has no tensor-parallel plan for {type(model).__name__} "
            f"(config.model_type={model_type!r}); supported model types: {supported_model_types()}. "
            "To add one, write a TPPlan (see taco_accel/models/llama.py) and call "
            "taco_accel.register_plan(plan)."
        )
    if not isinstance(getattr(model, plan.lm_head, None), nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no {plan.lm_head!r} module: parallelize takes a causal LM "
            f"(AutoModelForCausalLM), not the bare {type(model).__name__}"
        )
    return plan
