"""Checkpoints of tensor-parallel models in the plain transformers format.

`save_pretrained` gathers every split parameter (a collective) and rank 0 writes an ordinary
safetensors checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads. `from_pretrained`
builds the model with its parameters on the meta device, parallelises it, and then reads only
this rank's slices from the safetensors files (``safe_open`` + ``get_slice``), so a model that
fits in tp devices but not in one loads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from ..codec import TacoConfig
from ..tp.utils import ShardSpec
from .parallelize import context_of, parallelize

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """``{qualified parameter name: ShardSpec}`` of every split parameter."""
    specs = {}
    for mname, module in model.named_modules():
        for pname, spec in getattr(module, "shards", {}).items():
            if getattr(module, pname, None) is not None:
                specs[f"{mname}.{pname}" if mname else pname] = spec
    return specs


def tp_replicas(model: nn.Module, tp: int) -> dict[str, int]:
    """``{parameter name: how many of the tp ranks hold its values}``: tp for a replicated
    parameter, 1 for a split one (more where blocks are replicated, as kv heads can be)."""
    specs = shard_specs(model)
    return {n: specs[n].replicas if n in specs else tp for n, _ in model.named_parameters()}


def _gather(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor from every rank's part (parts may differ in size: padded on the wire)."""
    sizes = [spec.size(r) for r in range(spec.tp)]
    padded = local
    if local.shape[spec.dim] < max(sizes):
        shape = list(local.shape)
        shape[spec.dim] = max(sizes) - local.shape[spec.dim]
        padded = torch.cat([local, local.new_zeros(shape)], dim=spec.dim)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return spec.assemble([p.narrow(spec.dim, 0, n) for p, n in zip(parts, sizes)])


def gather_state_dict(
    model: nn.Module, device: torch.device | str | None = "cpu", keys: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """The full state dict with transformers' names and shapes, on every rank of the TP group.

    A collective: every rank of the group calls it (and, for parameters that FSDP2 shards
    over a dp group, every rank of that group too). Tied parameters map to one tensor.
    ``keys``: keep only the entries whose name it accepts (e.g. a LoRA adapter's).
    """
    ctx = context_of(model)
    specs = shard_specs(model)
    full, done = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if keys is not None and not keys(name):
            continue
        if id(tensor) not in done:
            value = tensor.detach()
            if hasattr(value, "full_tensor"):  # an FSDP2 shard over dp: a collective over dp first
                value = value.full_tensor()
            if name in specs and ctx.tp > 1:
                value = _gather(value, specs[name], ctx.group)
            done[id(tensor)] = value if device is None else value.to(device)
        full[name] = done[id(tensor)]
    return full


def save_pretrained(model: nn.Module, path: str | os.PathLike, is_main_process: bool | None = None, **kwargs) -> None:
    """Write ``model`` as a normal transformers checkpoint (safetensors + config).

    Every rank calls it (the parameters are gathered); the main process (default: global
    rank 0) writes through transformers' ``save_pretrained`` (``kwargs`` go there, e.g.
    ``max_shard_size``); all ranks wait for the write to finish.
    """
    state_dict = gather_state_dict(model)
    distributed = dist.is_available() and dist.is_initialized()
    if is_main_process is None:
        is_main_process = not distributed or dist.get_rank() == 0
    if is_main_process:
        type(model).save_pretrained(model, path, state_dict=state_dict, is_main_process=True, **kwargs)
    if distributed:
        dist.barrier()


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(path, ...)`` of a tensor-parallel model gather its shards (a
    collective: every rank calls it) and write one plain transformers checkpoint: the
    transformers habit, which would otherwise write each rank's shards under the full config.
    An explicit ``state_dict=`` goes to transformers as it is."""
    model.save_pretrained = MethodType(_gathering_save_pretrained, model)  # deepcopy rebinds it


def _gathering_save_pretrained(self, save_directory, *args, **kwargs):
    if args or "state_dict" in kwargs:
        return type(self).save_pretrained(self, save_directory, *args, **kwargs)
    kwargs.pop("is_main_process", None)  # rank 0 writes
    save_pretrained(self, save_directory, **kwargs)


@contextmanager
def _parameters_on_meta():
    """Create every parameter on the meta device (buffers stay real: rotary tables etc.)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _checkpoint_dir(name_or_path: str | os.PathLike) -> str:
    if os.path.isdir(name_or_path):
        return os.fspath(name_or_path)
    from huggingface_hub import snapshot_download

    return snapshot_download(os.fspath(name_or_path), allow_patterns=["*.json", "*.safetensors"])


def _weight_files(path: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a checkpoint folder."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, SAFE_WEIGHTS)
    if not os.path.exists(single):
        raise ValueError(
            f"{path} holds no {SAFE_WEIGHTS} or {SAFE_INDEX}; taco_accel.from_pretrained reads safetensors only"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _default_device(group) -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_pretrained(
    name_or_path: str | os.PathLike,
    tp: int | None = None,
    compression=TacoConfig(),
    sequence_parallel: bool = False,
    device_mesh=None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **config_kwargs,
) -> nn.Module:
    """Load a transformers causal-LM checkpoint straight into a tensor-parallel model.

    Every rank calls it and reads only its own slices of the safetensors files. Arguments
    as `parallelize`; ``dtype`` defaults to the checkpoint's (its config), ``device`` to this
    rank's current CUDA device under NCCL and the CPU otherwise; ``config_kwargs`` override
    config fields (e.g. ``attn_implementation="sdpa"``). Returns the model in eval mode, as
    transformers does.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = _checkpoint_dir(name_or_path)
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parallelize(model, tp, compression, sequence_parallel, device_mesh)
    ctx = context_of(model)
    device = torch.device(device) if device is not None else _default_device(ctx.group)
    files = _weight_files(path)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in set(files.values())}
        _materialise(model, files, handles, ctx.rank, dtype, device)
    model.to(device)  # the buffers
    ctx.install_grad_sums(model)  # the parameter objects are new
    if os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    logger.info("loaded %s with tp=%d (rank %d reads its slices only)", path, ctx.tp, ctx.rank)
    return model


def _materialise(model: nn.Module, files: dict, handles: dict, rank: int, dtype, device) -> None:
    """Replace every meta parameter by this rank's slice read from the checkpoint."""
    specs = shard_specs(model)
    prefix = getattr(model, "base_model_prefix", "") + "."
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    loaded: dict[int, nn.Parameter] = {}
    for mname, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in loaded:
                candidates = [n for full in names[id(param)] for n in (full, full.removeprefix(prefix))]
                key = next((n for n in candidates if n in files), None)
                if key is None:
                    raise ValueError(f"the checkpoint has no tensor for {names[id(param)]}")
                spec = specs.get(f"{mname}.{pname}" if mname else pname)
                value = _read(handles[files[key]], key, spec, rank)
                if value.shape != param.shape:
                    raise ValueError(
                        f"{key}: the checkpoint slice is {list(value.shape)}, the model expects {list(param.shape)}"
                    )
                value = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
                loaded[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[pname] = loaded[id(param)]


def _read(handle, key: str, spec: ShardSpec | None, rank: int) -> torch.Tensor:
    if spec is None:
        return handle.get_tensor(key)
    view = handle.get_slice(key)
    parts = [view[index] for index in spec.index(rank)]
    return torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0]
