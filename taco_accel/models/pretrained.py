"""`from_pretrained`: a transformers checkpoint read straight into a tensor-parallel model.

It builds the model with its parameters on the meta device, parallelises it, and then reads
only this rank's slices from the safetensors files (``safe_open`` + ``get_slice``), so a model
that fits in tp devices but not in one loads. Writing is `taco_accel.models.state`.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..comm.policy import DEFAULT_COMPRESSION, Compression
from ..tp.shards import ShardSpec
from .context import context_of
from .parallelize import parallelize
from .state import shard_specs

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


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
    """``{tensor name: safetensors file}`` of a checkpoint folder. The index may name files of
    the folder only (no absolute path, no ``..``), each a regular file (a symlink to one, as in
    the hub cache, is fine; a FIFO or device is not)."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.lexists(index):
        try:
            with open(_regular(index), encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); re-save the "
                                  "checkpoint") from None
        files = {}
        for name, file in weight_map.items():
            parts = str(file).replace("\\", "/").split("/")
            if not isinstance(file, str) or os.path.isabs(file) or ".." in parts or not file:
                raise CheckpointError(f"{index} maps {name!r} to {file!r}, outside {path}: an index names files of "
                                      "its own folder only (planted or edited index)")
            files[name] = os.path.join(path, file)
        for file in set(files.values()):
            _regular(file)
        return files
    single = os.path.join(path, SAFE_WEIGHTS)
    if not os.path.lexists(single):
        raise ValueError(
            f"{path} holds no {SAFE_WEIGHTS} or {SAFE_INDEX}; taco_accel.from_pretrained reads safetensors only"
        )
    from safetensors import safe_open

    with safe_open(_regular(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _regular(path: str) -> str:
    """``path`` if it is (or links to) a regular file, else a CheckpointError: opening a FIFO
    would block, a device never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or folder); a checkpoint holds plain "
                              "files")
    return path


def _default_device(group) -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_pretrained(
    name_or_path: str | os.PathLike,
    tp: int | None = None,
    compression=DEFAULT_COMPRESSION,
    sequence_parallel: bool = False,
    device_mesh=None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **config_kwargs,
) -> nn.Module:
    """Load a transformers causal-LM checkpoint straight into a tensor-parallel model.

    Every rank calls it and reads only its own slices of the safetensors files. Arguments
    as `parallelize` (``compression`` too: ``"auto"`` by default); ``dtype`` defaults to the checkpoint's (its config), ``device`` to this
    rank's current CUDA device under NCCL and the CPU otherwise; ``config_kwargs`` override
    config fields (e.g. ``attn_implementation="sdpa"``). Returns the model in eval mode, as
    transformers does.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    compression = Compression.resolve(compression)  # a bad value fails before any file is read
    path = _checkpoint_dir(name_or_path)
    _regular(os.path.join(path, "config.json"))
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
    if os.path.lexists(os.path.join(path, "generation_config.json")):
        _regular(os.path.join(path, "generation_config.json"))
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
