"""What real and emulated tensor parallelism share when they rewrite a causal LM.

    check_tp(model, plan, tp)                 every shard of the first layer, so bad sizes raise first
    shard_for(style, module, dims, tp, name)  the split of one linear
    Rewrite                                   the swaps and hooks of one rewrite: the walk over the
                                              plan, collected first, then applied

`parallelize.TPRewrite` builds the layers of real TP (`taco_accel.tp.layers`) on this walk,
`emulate.EmulatedRewrite` those of `taco_accel.tp.emulate`: the same checks, the same shards and
the same communication sites, created in the same order under the same names.
"""

from __future__ import annotations

from torch import nn

from ..tp.shards import ShardSpec, divide, linear_layout
from ..tp.sites import Site
from .context import TPContext
from .plan import AttentionDims, EnterRegion, Rowwise, TPPlan


def check_tp(model: nn.Module, plan: TPPlan, tp: int) -> None:
    """Compute every shard of the first layer, so that bad sizes raise before any change."""
    dims = plan.dims(model.config)
    divide(dims.num_heads, tp, "num_attention_heads")
    layer = model.get_submodule(plan.layers)[0]
    for name, style in plan.layer.items():
        if not isinstance(style, EnterRegion):
            shard_for(style, layer.get_submodule(name), dims, tp, name)


def shard_for(style, module: nn.Module, dims: AttentionDims, tp: int, name: str) -> ShardSpec:
    """The output (Colwise) or input (Rowwise) split of the linear ``module``; ``name`` for messages."""
    in_features, out_features, _ = linear_layout(module)
    if isinstance(style, Rowwise):
        return ShardSpec.even(in_features, tp, what=f"{name}.in_features")
    if style.heads is None:
        return ShardSpec.even(out_features, tp, what=f"{name}.out_features")
    if style.heads == "q":
        block = ShardSpec.even(dims.num_heads, tp, what="num_attention_heads").scaled(dims.head_dim)
    else:
        block = ShardSpec.heads(dims.num_kv_heads, dims.head_dim, tp, what="num_key_value_heads")
    return ShardSpec.concat([block] * style.fused)


class Rewrite:
    """The module swaps and hooks of one `parallelize` call, collected before any is applied
    (so that an error leaves the model untouched); sites are created in forward order.

    `install` walks the plan: the embedding, then every decoder layer module by module (with
    the sequence-parallel split before the first layer and the gather after the final norm),
    then the lm head. A subclass says what each piece becomes: `embedding`, `layer_module`,
    `lm_head`, `sequence_split`, `sequence_gather`, and the head counts the attention modules
    are set to (`attention_heads`).
    """

    def __init__(self, model: nn.Module, plan: TPPlan, ctx: TPContext) -> None:
        self.model, self.plan, self.ctx = model, plan, ctx
        self.regions: dict[str, object] = {}  # EnterRegion module name -> its region
        self.dims = plan.dims(model.config)
        self.sp = ctx.sequence if ctx.sequence.enabled else None  # None: no sequence sites at all
        self.swaps: list[tuple[str, nn.Module]] = []
        self.pre_hooks: list[tuple[nn.Module, object]] = []
        self.post_hooks: list[tuple[nn.Module, object]] = []

    def site(self, name: str, direction: str) -> Site:
        return self.ctx.sites.site(f"{self.ctx.short(name)}/{direction}")

    def shard(self, style, module: nn.Module, name: str) -> ShardSpec:
        """The split of the linear ``name`` of a decoder layer (`shard_for`)."""
        return shard_for(style, module, self.dims, self.ctx.tp, name.rsplit(".", 1)[-1])

    def install(self) -> nn.Module:
        """Build everything first (an error leaves the model untouched), then swap and hook;
        returns the new lm head (for the loss)."""
        embedding = self.embedding()
        self.layers()
        head = self.lm_head(embedding)
        self.apply()
        return head

    def layers(self) -> None:
        layers, plan = self.model.get_submodule(self.plan.layers), self.plan
        if self.sp is not None:
            self.pre_hooks.append((layers[0], self.sequence_split(self.site(f"{plan.layers}.0", "bwd"))))
        num_heads, num_kv_heads = self.attention_heads()
        for index, layer in enumerate(layers):
            for rel, style in plan.layer.items():
                self.layer_module(f"{plan.layers}.{index}.{rel}", layer.get_submodule(rel), style)
            plan.set_local_heads(layer.get_submodule(plan.attention), num_heads, num_kv_heads)
        if self.sp is not None:
            final_norm = self.model.get_submodule(plan.final_norm)
            self.post_hooks.append((final_norm, self.sequence_gather(self.site(plan.final_norm, "fwd"))))

    def attention_heads(self) -> tuple[int, int]:
        """The (query, kv) head counts each attention module gets: one rank's share (a kv head
        replicated on several ranks when there are fewer kv heads than ranks)."""
        tp = self.ctx.tp
        return self.dims.num_heads // tp, max(self.dims.num_kv_heads // tp, 1)

    def apply(self) -> None:
        for name, new in self.swaps:
            parent, _, attr = name.rpartition(".")
            if name == self.plan.embedding:
                carry_forward_hooks(self.model.get_submodule(name), new)
            setattr(self.model.get_submodule(parent) if parent else self.model, attr, new)
        for module, hook in self.pre_hooks:
            module.register_forward_pre_hook(hook, with_kwargs=True)
        for module, hook in self.post_hooks:
            module.register_forward_hook(hook)

    # -- what each piece becomes -------------------------------------------------------------

    def embedding(self) -> nn.Module:
        """Collect the swap of the token embedding; returns the new module."""
        raise NotImplementedError

    def layer_module(self, name: str, module: nn.Module, style) -> None:
        """Collect the swap or hook of one module of a decoder layer (``style``: its plan entry)."""
        raise NotImplementedError

    def lm_head(self, embedding: nn.Module) -> nn.Module:
        """Collect the swap of the lm head, split like ``embedding``; returns the new module."""
        raise NotImplementedError

    def sequence_split(self, bwd: Site):
        """The forward pre-hook of the first layer that starts sequence parallelism."""
        raise NotImplementedError

    def sequence_gather(self, fwd: Site):
        """The forward hook of the final norm that gathers the sequence for the lm head."""
        raise NotImplementedError


# The bookkeeping dicts of nn.Module's forward hooks (with_kwargs / always_call / prepend flags).
FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def carry_forward_hooks(old: nn.Module, new: nn.Module) -> None:
    """Move ``old``'s forward (pre-)hooks onto ``new``, which replaces it with the same inputs
    and outputs: the token embedding, whose parallel layer returns the full embedding (sequence
    parallelism splits later, before the first layer). transformers' and peft's
    ``enable_input_require_grads`` hook lives there. The dicts themselves move, so the handles
    their owners hold still remove them. `checks.check_modules` refuses hooks on the swapped
    linears, whose outputs or inputs become this rank's shard."""
    for attr in FORWARD_HOOK_DICTS:
        carried = getattr(old, attr)
        if carried:
            assert not getattr(new, attr), f"{type(new).__name__} has {attr} of its own"
            setattr(new, attr, carried)
