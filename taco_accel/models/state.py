"""The full state of a tensor-parallel model: which parameters are split, gathering them, and
writing them as one plain transformers checkpoint.

`save_pretrained` gathers every split parameter (a collective) and rank 0 writes an ordinary
safetensors checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads; `parallelize`
binds it as the model's own ``save_pretrained`` (`bind_save_pretrained`), so the transformers
habit writes the whole model. Loading is `taco_accel.models.pretrained`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from ..tp.shards import ShardSpec


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
    ctx = model.taco
    specs = shard_specs(model)
    full, done = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if keys is not None and not keys(name):
            continue
        if id(tensor) not in done:
            if tensor.is_meta:
                raise ValueError(f"{name} is on the meta device (a shape without values): load or initialise the "
                                 "weights before gathering or saving them (taco_accel.from_pretrained reads them)")
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
    write_on_main(lambda: type(model).save_pretrained(model, path, state_dict=state_dict, is_main_process=True,
                                                      **kwargs), is_main_process)


def write_on_main(write: Callable[[], None], is_main_process: bool | None = None) -> None:
    """``write()`` on the main process (``is_main_process``; default: global rank 0), then every
    rank waits for it to finish (a barrier when distributed)."""
    distributed = dist.is_available() and dist.is_initialized()
    if is_main_process is None:
        is_main_process = not distributed or dist.get_rank() == 0
    if is_main_process:
        write()
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
