"""Data parallelism over the mesh's dp axis, and the gradient reductions a step ends with.

`apply_dp` prepares one module (a pipeline stage, or a whole transformers model): DDP (every
replica holds all of it and `DataParallelGradSync` averages the gradients over dp) or FSDP2
(``fully_shard`` per decoder layer and at the root: parameters, gradients and optimizer state
sharded over dp). The TP collectives inside run on the tp group and are untouched: DDP and
FSDP only ever see the dp group. `ReplicaGradSum` and `TiedEmbeddingSync` are the other sums
that `ModelParts.finish_gradients` runs after the last backward of a step.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .mesh import collective_timeout
from .stage import decoder_layers, taco_context

logger = logging.getLogger(__name__)


def apply_dp(module: nn.Module, mesh: DeviceMesh, mode: str = "ddp", *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Prepare ``module`` (a `StageModule` or a transformers causal LM) for data parallelism
    over ``mesh["dp"]``; returns the module to run (the same object).

    ``"ddp"`` leaves it as it is: its gradients are averaged over dp once per step by
    `DataParallelGradSync`, after the last backward (Megatron's DDP does the same with
    pipelining: there is nothing to overlap before the last micro-batch anyway). torch's
    DistributedDataParallel is not used: under pipelining with TP hooks its reducer counts
    parameters twice and fails in ``_rebuild_buckets``, and one code path serves both.
    ``"fsdp"`` applies FSDP2 (``fully_shard`` per decoder layer, then the root);
    ``param_dtype`` (e.g. bf16) is its compute dtype. dp=1 changes nothing.
    """
    dp_mesh = mesh["dp"]
    if mode not in ("ddp", "fsdp"):
        raise ValueError(f"data-parallel mode {mode!r} is not supported; use 'ddp' or 'fsdp'")
    if dp_mesh.size() == 1 or mode == "ddp":
        if dp_mesh.size() > 1:
            logger.info("applied data parallelism (ddp, gradients averaged after each step) over %d replicas",
                        dp_mesh.size())
        return module
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    wrapped = fully_shard(module, mesh=dp_mesh, mp_policy=mp)
    logger.info("applied data parallelism (fsdp) over %d replicas", dp_mesh.size())
    return wrapped


class ReplicaGradSum:
    """Sum the gradients of TP-replicated parameters that each TP rank applies to part of the
    data (norms under sequence parallelism, Qwen3's per-head q/k norms) over the tp group, after
    backward. `parallelize` does this with hooks on the parameters, but FSDP2 replaces the
    parameter objects and the hooks never fire: build this before `apply_dp` (it removes the
    hooks, so nothing is summed twice) and call it after the schedule, before clipping.
    """

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh):
        self.group = mesh["tp"].get_group()
        self.names: set[str] = set()
        for module in modules:
            context, prefix = taco_context(module)
            if context is not None:
                context.remove_grad_sums()
                self.names.update(prefix + n for n in context.grad_sum_params)
        self.stages = modules

    def __bool__(self) -> bool:
        return bool(self.names)

    def __call__(self) -> None:
        """One all-reduce over tp per gradient dtype, of all these gradients flattened."""
        grads = [local_tensor(p.grad) for stage in self.stages for name, p in stage.named_parameters()
                 if name in self.names and p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            all_reduce_flat([g for g in grads if g.dtype == dtype], self.group)


class DataParallelGradSync:
    """Average the gradients of ``stages`` over the dp group: one all-reduce per bucket of
    about ``bucket_bytes`` (flattened per dtype). Call after backward, before clipping."""

    def __init__(self, stages: list[nn.Module], mesh: DeviceMesh, bucket_bytes: int = 64 * 2**20):
        self.group, self.size = mesh["dp"].get_group(), mesh["dp"].size()
        self.params = [p for s in stages for p in s.parameters() if p.requires_grad]
        self.bucket_bytes = bucket_bytes

    def _buckets(self):
        bucket, nbytes = [], 0
        for p in self.params:
            if bucket and (p.grad.dtype != bucket[0].dtype or nbytes >= self.bucket_bytes):
                yield bucket
                bucket, nbytes = [], 0
            bucket.append(p.grad)
            nbytes += p.grad.numel() * p.grad.element_size()
        if bucket:
            yield bucket

    def __call__(self) -> None:
        for p in self.params:  # a parameter unused on this replica still takes part
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for grads in self._buckets():
            all_reduce_flat(grads, self.group, divide=self.size)


def all_reduce_flat(tensors: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum ``tensors`` (one dtype) over ``group`` in place through one flat buffer, one
    all-reduce; ``divide``: then divide by it (an average over replicas)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(summed)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``: the local shard of a DTensor (FSDP2), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class TiedEmbeddingSync:
    """Keeps a tied embedding and head equal when they live on different pipeline stages.

    Megatron's embedding group: after backward, the embedding (first stage) and the head copy
    (last stage) of the same (dp, tp) coordinate add their gradients, so both take the same
    optimizer step. Build it on every rank (it creates process groups).
    """

    def __init__(self, stages: list[nn.Module], mesh: DeviceMesh, first_param: nn.Parameter | None,
                 last_param: nn.Parameter | None):
        self.first, self.last = first_param, last_param
        self.group = None
        pp = mesh["pp"].size()
        if pp > 1:
            ranks = mesh.mesh  # (pp, dp, tp) tensor of global ranks
            me = dist.get_rank()
            for d in range(ranks.shape[1]):
                for t in range(ranks.shape[2]):
                    pair = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
                    group = dist.new_group(pair, timeout=collective_timeout())
                    if me in pair:
                        self.group = group

    def __call__(self) -> None:
        if self.first is not None and self.last is not None:  # both on this rank
            self.first.grad.add_(self.last.grad)
            self.last.grad.copy_(self.first.grad)
        elif self.group is not None:
            p = self.first if self.first is not None else self.last
            if p is not None and p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=self.group)

