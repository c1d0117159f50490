"""A pipeline stage of a transformers causal LM: embed (first) -> its layers -> final norm (last).

`StageModule` runs one contiguous slice of a (possibly pruned) transformers model. Only the
hidden states travel between stages; each stage rebuilds what the decoder layers also need
(position ids, rotary position embeddings, the causal mask) from the hidden states' shape, as
``Qwen2Model.forward`` does, so nothing model-specific crosses the wire. Parameter names stay
those of the transformers model (``model.layers.3.mlp.down_proj.weight``): a stage's
state_dict is a subset of the full model's.

The text is packed (no padding), so the mask is purely causal and positions are ``0..s-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..upstream.transformers import mask_builders


@dataclass(frozen=True)
class Family:
    """Where the parts of one architecture family live, as attribute names inside the decoder
    model ``base``: read from the family's `TPPlan`, the one registry of architectures."""

    base: str  # the decoder model inside the causal LM ("model" or "transformer")
    embed: str  # token embedding, inside base
    layers: str  # ModuleList of decoder layers, inside base
    norm: str  # final norm, inside base
    position_embed: str | None = None  # learned absolute positions (GPT-2 "wpe")
    dropout: str | None = None  # embedding dropout (GPT-2 "drop")
    rotary: str | None = None  # rotary embedding module (Llama-likes "rotary_emb")

    @classmethod
    def of(cls, plan) -> "Family":
        def inside(name: str | None) -> str | None:
            return None if name is None else name[len(plan.base) + 1:]

        return cls(plan.base, inside(plan.embedding), inside(plan.layers), inside(plan.final_norm),
                   inside(plan.position_embedding), inside(plan.embedding_dropout), inside(plan.rotary))


def family_of(model: nn.Module) -> Family:
    """The stage layout of a transformers causal LM (a ValueError naming the supported ones)."""
    from ..models import plan_of_type, supported_model_types

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    plan = plan_of_type(model_type)
    if plan is None:
        raise ValueError(f"model_type={model_type!r} has no registered plan (stage layout); supported: "
                         f"{supported_model_types()}")
    return Family.of(plan)


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of a `StageModule` (its own) or of a transformers causal LM (all)."""
    if isinstance(module, StageModule):
        return [layer for _, layer in module.layer_items()]
    model = module.get_base_model() if hasattr(module, "get_base_model") else module  # peft: the causal LM
    fam = family_of(model)
    return list(getattr(getattr(model, fam.base), fam.layers))


def taco_context(module: nn.Module):
    """``(model.taco, name prefix)`` of a `StageModule` ("model.") or a parallelised model ("");
    ``(None, "")`` when the module is not tensor parallel."""
    if isinstance(module, StageModule):
        return getattr(module.model, "taco", None), "model."
    if hasattr(module, "get_base_model"):  # peft: parameter names gain the wrappers' prefix
        return getattr(module.get_base_model(), "taco", None), "base_model.model."
    return getattr(module, "taco", None), ""


def site_tables(module: nn.Module) -> list:
    """The communication site tables of a module of `ModelParts.modules`: its model's TP sites
    (``model.taco.sites``, which a tensor-parallel pipeline's boundaries join) and, for a
    pipeline stage of a model without TP, its boundaries' own table; each once."""
    context, _ = taco_context(module)
    tables = [] if context is None else [context.sites]
    boundaries = getattr(module, "boundaries", None)
    if boundaries is not None and all(boundaries.table is not t for t in tables):
        tables.append(boundaries.table)
    return tables


def causal_masks(config, hidden: torch.Tensor, builders: dict) -> dict:
    """The causal mask(s) of a packed batch, keyed by layer type, as the HF model builds them
    (``builders``: `mask_builders`, resolved when the stage is built). Without position ids: the
    stage's are ``0..s-1``, which restart no sequence, and given them transformers would read them
    on the host to look for restarts (a host sync every forward)."""
    masks = {"full_attention": builders["full_attention"](config, hidden, None)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        masks["sliding_attention"] = builders["sliding_attention"](config, hidden, None)
    return masks


class StageModule(nn.Module):
    """Runs the layers ``model`` still holds, plus the embedding on the first stage and the
    final norm on the last (the head belongs to the loss: `models.loss.hidden_loss`, and
    `models.loss.hidden_logits` for a loss of the logits).

    ``forward(x)``: x is ``input_ids (b, s)`` on the first stage, hidden states ``(b, s, h)``
    elsewhere; returns hidden states, on the last stage the final norm's.
    """

    def __init__(self, model: nn.Module, is_first: bool = True, is_last: bool = True, seq_split: int = 1):
        super().__init__()
        self.model = model  # the (pruned) transformers causal LM; its keys stay HF keys
        self.family = family_of(model)
        self.is_first, self.is_last = is_first, is_last
        # with sequence parallelism the hidden states between stages hold 1/tp of the tokens
        self.seq_split = seq_split
        # what crosses to other ranks: boundary.Boundary / PipelineBoundaries, set by apply_pp
        self.inbound = self.outbound = self.boundaries = None
        self.mask_builders = mask_builders()

    # -- parts ------------------------------------------------------------------------------
    def _base(self) -> nn.Module:
        return getattr(self.model, self.family.base)

    def _layers(self):
        return getattr(self._base(), self.family.layers)

    def _layer_ids(self) -> list[int]:
        layers = self._layers()
        if isinstance(layers, nn.ModuleDict):
            return sorted(int(k) for k in layers.keys())
        return list(range(len(layers)))

    def layer_items(self) -> list[tuple[int, nn.Module]]:
        """``(global layer index, layer)`` for the layers of this stage, in order."""
        layers = self._layers()
        return [(i, layers[str(i)] if isinstance(layers, nn.ModuleDict) else layers[i]) for i in self._layer_ids()]

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, fam, config = self._base(), self.family, self.model.config
        if self.is_first:
            input_ids = x  # (b, s)
            x = getattr(base, fam.embed)(input_ids)  # (b, s, h)
            seq = input_ids.shape[1]
        else:
            seq = x.shape[1] * self.seq_split  # x: (b, s/seq_split, h)
            if self.seq_split > 1:  # layer 0's hook starts sequence parallelism; it ran elsewhere
                self.model.taco.sequence.begin(seq)
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0)  # (1, s)
        if self.is_first and fam.position_embed:
            x = x + getattr(base, fam.position_embed)(position_ids)
        if self.is_first and fam.dropout:
            x = getattr(base, fam.dropout)(x)
        layer_items = self.layer_items()
        if layer_items:
            full = x if x.shape[1] == seq else x[:, :1].expand(-1, seq, -1)  # (b, s, h) shape, no copy
            masks = causal_masks(config, full, self.mask_builders)
            kwargs = {"position_ids": position_ids}
            if fam.rotary:
                kwargs["position_embeddings"] = getattr(base, fam.rotary)(full, position_ids)
            layer_types = getattr(config, "layer_types", None)
            for i, layer in layer_items:
                mask = masks[layer_types[i]] if layer_types else masks["full_attention"]
                x = layer(x, attention_mask=mask, **kwargs)
                if isinstance(x, tuple):  # older layer forwards return (hidden_states, ...)
                    x = x[0]
        if self.is_last:
            x = getattr(base, fam.norm)(x)  # (b, s, h): the loss function applies the head (models.loss.hidden_loss)
        return x
