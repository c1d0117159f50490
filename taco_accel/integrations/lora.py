"""peft LoRA on tensor-parallel layers: adapters that shard like their layer and share its collectives.

peft wraps an unknown layer with its plain ``Linear`` LoRA, which on a tensor-parallel layer
skips the TP collectives and is silently wrong. `get_peft_model` registers `TPLoraLinear`
for our `ColumnParallelLinear` / `RowParallelLinear` (peft's ``LoraConfig._register_custom_module``)
and then calls peft's own ``get_peft_model``; everything else (``print_trainable_parameters``,
adapters on/off, ``merge_and_unload``) is peft's. The math, per layer, ``y = W x + s B A x``:

- column parallel, W [out/tp, in]: ``B`` [out/tp, r] is split like W's rows, ``A`` [r, in] is
  replicated. The layer's input already went through f (its gradient is all-reduced there),
  but A's gradient from this rank only sees this rank's outputs: it is summed over the group.
- row parallel, W [out, in/tp]: ``A`` [r, in/tp] is split like W's columns, ``B`` [out, r] is
  replicated. ``s B A x_local`` is a partial sum like ``W x_local``: it is added *before* the
  layer's reduce (one collective for both, compressed like it), and B's gradient, computed
  from this rank's partial input, is summed over the group.

Initialisation draws the *full* A and B exactly as peft does on one process (same RNG calls in
the same order), broadcasts them from the group's first rank and keeps this rank's slice: the
same seed gives the same adapter as plain peft on the unparallelised model. `save_adapter`
writes full shapes in peft's format, which ``PeftModel.from_pretrained`` loads on one process
into the original model; `load_adapter` reads such an adapter back into a TP model, and
`tensor_parallel_lora` moves a plain peft model's adapter onto TP layers (`taco_trainer`'s
``SFTTrainer(peft_config=...)``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models import context_of, gather_state_dict, parallelize
from ..models.state import shard_specs, write_on_main
from ..tp import ColumnParallelLinear, RowParallelLinear, SiteTable, copy_to_tp_region, sum_replica_grads
from ..upstream import peft as upstream_peft

logger = logging.getLogger(__name__)

INIT_CHOICES = (True, False, "gaussian")  # inits that need no (sharded) base weight
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft():
    try:
        import peft
    except ImportError:
        raise RuntimeError("LoRA needs peft: pip install peft") from None
    return peft


def _make_tp_lora_linear():
    from peft.tuners.lora.layer import Linear

    class TPLoraLinear(upstream_peft.BaseLayerSizes, Linear):
        """peft LoRA for a `ColumnParallelLinear` / `RowParallelLinear` (see the module docstring).

        ``in_features`` / ``out_features`` are the full layer's (peft draws the initial A and B
        on them); the live ``lora_B`` (column) or ``lora_A`` (row) holds this rank's slice and
        carries a ``shards`` entry, so `gather_state_dict` reassembles it. ``sites``: the
        model's `SiteTable`, whose ledger records the sum of the replicated factor's gradient;
        ``names``: the qualified name of each parallel linear by ``id`` (`resolve_lora_config`
        binds both). peft's own arguments (the adapter's ``config`` among them) pass through as
        peft gives them.
        """

        def __init__(self, base_layer, adapter_name, *args, sites: SiteTable, names: dict[int, str], **kwargs):
            base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
            name = names.get(id(base))
            _check_layer(base, name or type(base).__name__)  # names the lm head, which has none
            if name is None:
                raise ValueError(f"{type(base).__name__}: not a parallel linear of the model the LoRA config was resolved "
                                 "for; add the adapters with taco_accel.get_peft_model(model, lora_config)")
            super().__init__(base_layer, adapter_name, *args, **kwargs)
            self.fan_in_fan_out = base.conv1d  # delta W in the base weight's layout
            self._tp_grad_site = sites.plain(f"{name}.lora/grad")  # plain: weight gradients

        @property
        def _tp_row(self) -> bool:
            return isinstance(self.get_base_layer(), RowParallelLinear)

        @property
        def lora_variants(self):
            return {(): None}  # DoRA & co. are refused by check_lora_config before we get here

        def update_layer(self, adapter_name, *args, **kwargs):
            super().update_layer(adapter_name, *args, **kwargs)  # full shapes, peft's RNG draws
            base = self.get_base_layer()
            _broadcast_from_first(self.lora_A[adapter_name].weight, base.group)
            _broadcast_from_first(self.lora_B[adapter_name].weight, base.group)
            if self._tp_row:  # A [r, in] -> [r, in/tp], split like W's columns
                _keep_slice(self.lora_A[adapter_name], base.shard.on_dim(1), base.rank, "in_features")
            else:  # B [out, r] -> [out/tp, r], split like W's rows
                _keep_slice(self.lora_B[adapter_name], base.shard.on_dim(0), base.rank, "out_features")

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("adapter_names= (mixed-adapter batches) is not supported on tensor-parallel layers")
            if self.disable_adapters and self.merged:
                self.unmerge()
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if self.disable_adapters or self.merged or not adapters:
                return self.base_layer(x, *args, **kwargs)
            base = self.get_base_layer()
            if not self._tp_row:
                out = self.base_layer(x, *args, **kwargs)  # (b, s, out/tp)
                return out + self._delta(x, adapters).to(out.dtype)
            partial = base.partial(x)  # (b, s, out), this rank's share of W x
            out = base.reduce(partial + self._delta(x, adapters).to(partial.dtype))  # one collective for both
            return out if base.bias is None else out + base.bias.to(out.dtype)  # as RowParallelLinear

        def _delta(self, x: torch.Tensor, adapters: list[str]) -> torch.Tensor:
            """``sum_a s_a B_a A_a dropout(x)``: this rank's output slice (column) or partial sum (row)."""
            base, total = self.get_base_layer(), 0
            for name in adapters:
                a_weight, b_weight = self.lora_A[name].weight, self.lora_B[name].weight
                if self._tp_row:  # B is replicated but sees this rank's partial input
                    b_weight = copy_to_tp_region(b_weight, self._tp_grad_site)
                else:  # A is replicated but only sees this rank's output slice
                    a_weight = copy_to_tp_region(a_weight, self._tp_grad_site)
                    if base.shard.replicas > 1:  # replicated kv heads: B's rows too
                        b_weight = sum_replica_grads(b_weight, self.lora_B[name].shards["weight"], base.replica_site)
                h = self.lora_dropout[name](upstream_peft.cast_input_dtype(self, x, a_weight.dtype))
                total = total + F.linear(F.linear(h, a_weight), b_weight) * self.scaling[name]
            return total

        def __repr__(self) -> str:
            return "lora." + nn.Module.__repr__(self)

    return TPLoraLinear


_TP_LORA_LINEAR = None


def tp_lora_linear():
    """The `TPLoraLinear` class, built on first use so that ``import taco_accel`` does not import
    peft (2 s); also reachable as ``taco_accel.integrations.lora.TPLoraLinear`` (pickle finds it)."""
    global _TP_LORA_LINEAR
    if _TP_LORA_LINEAR is None:
        _TP_LORA_LINEAR = _make_tp_lora_linear()
        _TP_LORA_LINEAR.__module__, _TP_LORA_LINEAR.__qualname__ = __name__, "TPLoraLinear"
    return _TP_LORA_LINEAR


def __getattr__(name: str):
    if name == "TPLoraLinear":
        return tp_lora_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_layer(base: nn.Module, name: str) -> None:
    if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(f"{name}: LoRA on tensor-parallel models targets column / row parallel linears, "
                         f"not {type(base).__name__}")
    if isinstance(base, ColumnParallelLinear) and (base.entry is not None or base.gather is not None):
        raise ValueError(f"{name}: LoRA on the vocab-parallel lm head is not supported; target the attention "
                         "and MLP projections (e.g. target_modules='all-linear')")


def _broadcast_from_first(param: torch.Tensor, group) -> None:
    """Every rank of ``group`` gets the first rank's values (the replicated draw, whatever the RNG state)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(param.data, group=group, group_src=0)


def _keep_slice(linear: nn.Linear, spec, rank: int, attr: str) -> None:
    """Replace ``linear``'s full weight by this rank's slice (``spec`` in the [out, in] layout)."""
    weight = linear.weight
    linear.weight = nn.Parameter(spec.take(weight.detach(), rank), requires_grad=weight.requires_grad)
    setattr(linear, attr, linear.weight.shape[spec.dim])
    linear.shards = {"weight": spec}


# -- configuration ---------------------------------------------------------------------------

def _refuse(field: str, value, fix: str) -> None:
    raise ValueError(f"LoraConfig.{field}={value!r} is not supported on tensor-parallel layers; {fix}")


def check_lora_config(config) -> None:
    """ValueError for the LoraConfig options that TP LoRA does not support, saying what to use."""
    peft = _peft()
    if not isinstance(config, peft.LoraConfig):
        raise ValueError(f"expected a peft.LoraConfig, got {type(config).__name__}; taco_accel supports LoRA only")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        # LoRA variants (DoRA & co.: computed by a variant object our forward does not run), which
        # peft marks with the field metadata is_lora_variant (every supported peft, from 0.20)
        if field.metadata.get("is_lora_variant") and value:
            _refuse(field.name, value, "use plain LoRA (leave it unset)")
    if config.init_lora_weights not in INIT_CHOICES:
        _refuse("init_lora_weights", config.init_lora_weights, f"use one of {INIT_CHOICES} (these need no "
                "access to the full base weight)")
    simple = {
        "lora_bias": (False, "set it to False"),
        "bias": ("none", "use bias='none' (train biases with full fine-tuning)"),
        "use_qalora": (False, "set it to False"),
        "megatron_config": (None, "taco_accel's own parallel layers are used instead"),
        "modules_to_save": (None, "train the embedding / head with full fine-tuning, or leave it unset"),
        "trainable_token_indices": (None, "leave it unset"),
        "target_parameters": (None, "target modules (target_modules=...) instead"),
        "layer_replication": (None, "leave it unset"),
    }
    for field, (allowed, fix) in simple.items():
        value = getattr(config, field, allowed)
        if value not in (allowed, [], {}):
            _refuse(field, value, fix)


def parallel_linear_names(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: layer}`` of the column / row parallel linears LoRA can target (not the lm head)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if not (isinstance(module, ColumnParallelLinear) and module.gather is not None):
                out[name] = module
    return out


def resolve_lora_config(model: nn.Module, config):
    """A copy of ``config`` with explicit target modules, checked against ``model``'s parallel layers,
    and `TPLoraLinear` registered for them (bound to the model's site table)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    check_lora_config(config)
    config = copy.deepcopy(config)
    targets = parallel_linear_names(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in targets})
    if config.target_modules is None:
        default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.model_type)
        if default is None:
            raise ValueError(f"no default LoRA target modules for {model.config.model_type!r}; pass "
                             f"target_modules (e.g. 'all-linear' or some of {suffixes})")
        config.target_modules = set(default)
    elif config.target_modules == "all-linear":
        config.target_modules = set(suffixes)
    matched = [n for n, _ in model.named_modules() if bool(check_target_module_exists(config, n))]
    if not matched:
        raise ValueError(f"target_modules={config.target_modules!r} matches no module; the parallel linears "
                         f"LoRA can target are {suffixes} (or 'all-linear')")
    wrong = [n for n in matched if n not in targets]
    if wrong:
        raise ValueError(f"target_modules={config.target_modules!r} matches {wrong[:3]}, which are not column / "
                         f"row parallel linears (the lm head, norms and embeddings are not); use some of {suffixes}")
    conv1d = {targets[n].conv1d for n in matched}
    config.fan_in_fan_out = conv1d == {True}  # GPT-2's Conv1D: what peft expects on the original model
    names = {id(module): name for name, module in targets.items()}
    layer = functools.partial(tp_lora_linear(), sites=context_of(model).sites, names=names)
    upstream_peft.register_custom_modules(config, {ColumnParallelLinear: layer, RowParallelLinear: layer})
    return config


def get_peft_model(model: nn.Module, config, adapter_name: str = "default", **kwargs):
    """peft's ``get_peft_model`` for a model made tensor parallel by `taco_accel.parallelize`.

    Every rank calls it (the initial A and B are broadcast from the group's first rank; with
    the same seed they equal peft's on the unparallelised model). ``config`` is a
    ``peft.LoraConfig``: ``target_modules`` may name any of the attention / MLP projections or
    be ``"all-linear"``; DoRA and other variants, ``lora_bias``, ``modules_to_save`` and
    inits that read the base weight (PiSSA, OLoRA, LoftQ, ...) raise a ValueError. ``kwargs``
    go to ``peft.get_peft_model``. The returned model's ``save_pretrained`` is `save_adapter`
    (peft's own would write this rank's slices).
    """
    context_of(model)  # a ValueError when the model is not parallelised
    config = resolve_lora_config(model, config)
    peft_model = _peft().get_peft_model(model, config, adapter_name=adapter_name, **kwargs)
    peft_model.save_pretrained = functools.partial(save_adapter, peft_model)
    logger.info("LoRA r=%d on %d tensor-parallel layers (%s)", config.r, len(_lora_layers(peft_model)),
                ", ".join(sorted(config.target_modules)))
    return peft_model


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    cls = tp_lora_linear()
    return [m for m in model.modules() if isinstance(m, cls)]


# -- adapters in and out ---------------------------------------------------------------------

def _is_adapter_key(name: str, adapter_name: str) -> bool:
    return ".lora_" in name and f".{adapter_name}." in name


def gather_adapter_state_dict(peft_model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors at full (unsharded) shapes, keyed as in ``peft_model.state_dict()``.

    A collective over the TP group (every rank calls it and gets the result).
    """
    return gather_state_dict(peft_model, keys=lambda name: _is_adapter_key(name, adapter_name))


def save_adapter(peft_model: nn.Module, path: str | os.PathLike, selected_adapters: list[str] | None = None,
                 is_main_process: bool | None = None, **kwargs) -> None:
    """Write the adapters (default: all) in peft's format at full shapes: ``PeftModel.from_pretrained``
    loads them on one process into the original model. Every rank calls it; the main process
    (default: global rank 0) writes; all ranks wait. ``kwargs`` go to peft's ``save_pretrained``.
    The ``save_pretrained`` of a model from `get_peft_model` is this function."""
    names = list(selected_adapters or peft_model.peft_config)
    state = {}
    for name in names:
        state.update(gather_adapter_state_dict(peft_model, name))
    save = type(peft_model).save_pretrained  # peft's own method (the instance attribute is this function)
    write_on_main(lambda: save(peft_model, os.fspath(path), selected_adapters=names, state_dict=state, **kwargs),
                  is_main_process)


def _read_adapter(source) -> dict[str, torch.Tensor]:
    if isinstance(source, dict):
        return source
    from safetensors.torch import load_file

    file = os.path.join(os.fspath(source), ADAPTER_WEIGHTS)
    if not os.path.exists(file):
        raise ValueError(f"{source} holds no {ADAPTER_WEIGHTS}; pass a folder written by save_adapter or "
                         "PeftModel.save_pretrained")
    return load_file(file)


def load_adapter(model: nn.Module, source, adapter_name: str = "default", is_trainable: bool = False):
    """Load a full-shape peft adapter (a folder or its state dict) into a TP model; returns the peft model.

    ``model``: a parallelised model (a peft model is built from the folder's ``adapter_config.json``)
    or a peft model from `get_peft_model` that already has ``adapter_name``. Each rank keeps its slices.
    """
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        if isinstance(source, dict):
            raise ValueError("to load a state dict, first build the peft model with taco_accel.get_peft_model")
        config = peft.LoraConfig.from_pretrained(os.fspath(source))
        config.inference_mode = not is_trainable
        model = get_peft_model(model, config, adapter_name=adapter_name)
    if adapter_name not in model.peft_config:
        raise ValueError(f"the peft model has no adapter {adapter_name!r} to load into (its adapters: "
                         f"{sorted(model.peft_config)}); pass one of those as adapter_name, or load into the "
                         "parallelised model without adapters (a peft model is built from the folder)")
    full = _read_adapter(source)
    specs = shard_specs(model)
    rank = context_of(model).rank
    missing = []
    for name, param in model.named_parameters():
        if not _is_adapter_key(name, adapter_name):
            continue
        key = name.replace(f".{adapter_name}.", ".")
        if key not in full:
            missing.append(key)
            continue
        value = full[key] if name not in specs else specs[name].take(full[key], rank)
        if value.shape != param.shape:
            raise ValueError(f"{key}: the adapter holds {list(full[key].shape)}, which does not fit this model "
                             f"({list(param.shape)} on this rank); was it trained for another base model or r?")
        with torch.no_grad():
            param.copy_(value)
    if missing:
        raise ValueError(f"the adapter has no tensor for {missing[:3]} ({len(missing)} missing); it was trained "
                         "with other target_modules")
    return model


def tensor_parallel_lora(model: nn.Module, tp_mesh, compression, sequence_parallel: bool) -> nn.Module:
    """A peft model whose plain LoRA layers sit on an unparallelised base (peft's ``get_peft_model``,
    ``SFTTrainer(peft_config=...)``) -> its base parallelised over ``tp_mesh`` (`parallelize`'s
    ``device_mesh``, with ``compression`` and ``sequence_parallel``) and the same adapter values
    on tensor-parallel LoRA layers; any other model is returned as it is. The global RNG is left
    as it was."""
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError:
        return model
    if not isinstance(model, PeftModel) or getattr(model.get_base_model(), "taco", None) is not None:
        return model
    if len(model.peft_config) != 1:
        raise ValueError(f"the peft model has adapters {sorted(model.peft_config)}; taco_accel trains one")
    (name, config), = model.peft_config.items()
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    base = model.unload()  # the transformers model, each LoRA layer back to its base layer
    parallelize(base, device_mesh=tp_mesh, compression=compression, sequence_parallel=sequence_parallel)
    with torch.random.fork_rng(devices=[]):  # the new adapter's draws are overwritten below
        tp_model = get_peft_model(base, config, adapter_name=name)
    load_adapter(tp_model, adapter, adapter_name=name, is_trainable=True)
    logger.info("LoRA adapter %r moved onto the tensor-parallel layers (tp=%d)", name, context_of(base).tp)
    return tp_model


def export_merged(peft_model: nn.Module, path: str | os.PathLike, **kwargs) -> nn.Module:
    """Merge the adapter into the base weights (``merge_and_unload``) and write a plain transformers
    checkpoint (every rank calls it). Returns the merged TP model; the peft model is used up."""
    from ..models import save_pretrained

    merged = peft_model.merge_and_unload()
    save_pretrained(merged, path, **kwargs)
    return merged
