"""Data parallelism over the mesh's dp axis, and the gradient reductions a step ends with.

`apply_dp` prepares one module (a pipeline stage, or a whole transformers model): DDP (every
replica holds all of it and `DataParallelGradSync` averages the gradients over dp) or FSDP2
(``fully_shard`` per decoder layer and at the root: parameters, gradients and optimizer state
sharded over dp). The TP collectives inside run on the tp group and are untouched: DDP and
FSDP only ever see the dp group. `ReplicaGradSum` and `TiedEmbeddingSync` are the other sums
that `ModelParts.finish_gradients` runs after the last backward of a step.

**Compressed gradient reduction** (``grad_compression``, a `Compression`; off by default). The
dp sites are `comm.Site`s named ``dp.grad.<bucket or FSDP unit>/reduce_scatter`` (and
``/all_gather`` for DDP), in a `SiteTable` over the dp group that records into the model's
ledger: the codec, the auto decision, statistics and agreement checks of the TP sites. Their
settings are ``grad_compression``'s own, read as every site's are (`Compression.rule_for`: a
site not named ``*/fwd`` takes the ``backward`` settings, then the ``sites`` patterns; the
floor and the piece size), through the `SiteTable` that `grad_sites` builds.

- DDP: each bucket is reduce-scattered (each rank sums its 1/P of the values, fp32), averaged,
  and all-gathered; FSDP2: its own reduce-scatter of each unit is replaced
  (``FSDPModule.set_custom_reduce_scatter``, `FsdpReduceScatter`). Same bytes as the two-shot
  all-reduce: 2(P-1)/P n (1 + 4/G) per rank for DDP, half that for FSDP2.
- What keeps it convergent, both (`feedback_average`):
  **error feedback** (EF-SGD: Seide et al. 2014, Karimireddy et al. 2019; applied at both ends of
  the exchange as in DoubleSqueeze, Tang et al. 2019, and 1-bit Adam, Tang et al. 2021): each
  rank adds to its gradient what its encodings have not delivered yet (its *worker residual*),
  and keeps what this step's encoding loses; the rank that averages a shard does the same for
  the all-gather's encoding of it (its *server residual*). Nothing is lost, only delayed: over
  any number of steps, what was delivered plus the residuals is the sum of the true gradients
  (to fp32 rounding). Round-to-nearest FP8 is deterministic, so a small gradient component that
  recurs every step (a rare token's embedding row, a parameter whose gradient sits in a group
  with a much larger one) would otherwise be rounded the same way, a bias, every step; and
  **fp32 accumulation of the received chunks**: a reduce-scatter with a residual decodes what
  it receives and sums in fp32 (`comm.collectives`), instead of requantising the sum as the
  two-shot does, so each value is quantised once per exchange and all of its error is in a
  residual. EF21 (Richtarik et al. 2021) would keep a full gradient-sized state on every rank
  twice over (its estimate and the aggregate) for a guarantee that matters for biased sparsifiers
  (top-k); the codec here is an 8-bit quantiser of about 2.5% error per message, for which the
  classic form is the standard (1-bit Adam, DeepSpeed) at half the state.
- Memory: fp32 residuals of 4 bytes per local gradient value (the worker residual: the whole
  replica's gradient, also under FSDP2, whose unsharded reduce-scatter input it mirrors: P times
  the sharded gradient FSDP2 keeps) plus 4/P bytes (DDP's server residual); the flat buffer of a
  bucket while it is reduced. A non-finite gradient is delivered as such (the step fails or is
  skipped, as uncompressed) and never carried: residuals keep finite values only.
- Checkpoints hold the residuals (`ModelParts.feedback_state`); a resume on the same mesh and
  dp mode continues bit for bit, one on another mesh starts them at zero (what they hold is at
  most one step's quantisation error of the gradient; logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import Ledger, Site
from ..comm.policy import Compression
from ..tp.sites import SiteTable
from .mesh import pp_pair_groups
from .stage import decoder_layers, taco_context

logger = logging.getLogger(__name__)

GRAD_SITE = "dp.grad"  # the prefix of every data-parallel gradient site


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
    about ``bucket_bytes`` (flattened per dtype). Call after backward, before clipping.

    ``sites`` (a `grad_sites` table): the compressed reduction of the module doc instead, per
    bucket a reduce-scatter and an all-gather with error feedback; its residuals are
    `feedback_state`."""

    def __init__(self, stages: list[nn.Module], mesh: DeviceMesh, bucket_bytes: int = 64 * 2**20,
                 sites: SiteTable | None = None):
        self.group, self.size = mesh["dp"].get_group(), mesh["dp"].size()
        self.params = [p for s in stages for p in s.parameters() if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        self.sites = sites
        self.feedback: dict[str, _BucketFeedback] = {}

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
        for i, grads in enumerate(self._buckets()):
            if self.sites is None:
                all_reduce_flat(grads, self.group, divide=self.size)
            else:
                self._compressed(f"{GRAD_SITE}.bucket{i}", grads)

    def _compressed(self, name: str, grads: list[torch.Tensor]) -> None:
        """The bucket ``name``: reduce-scatter, average, all-gather, with error feedback."""
        world = self.size
        rs, ag = self.sites.site(f"{name}/reduce_scatter"), self.sites.site(f"{name}/all_gather")
        numel = sum(g.numel() for g in grads)
        align = world * (rs.config.group_size if rs.config is not None else 128)
        padded = -(-numel // align) * align  # whole groups per rank: no staging copies
        state = self.feedback.get(name)
        if state is None or not state.fits(padded, world, grads[0].device):
            if state is not None:
                logger.warning("%s: the gradient layout changed (%d values, was %d): its error-feedback residuals "
                               "start again from zero", name, padded, state.worker.numel())
            state = self.feedback[name] = _BucketFeedback.zeros(padded, world, grads[0].device)
        pad = grads[0].new_zeros(padded - numel, dtype=torch.float32)
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), pad])  # [P * m], fp32
        full = feedback_average(
            [flat], [state.worker], [state.server],
            lambda xs, lost: [rs.run("reduce_scatter", xs[0].view(world, -1), residual=lost[0]).view(-1)],
            lambda xs, lost: ag.run("all_gather", xs[0], residual=lost[0]), divide=world)
        for g, part in zip(grads, full[:numel].split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def feedback_state(self) -> dict[str, torch.Tensor]:
        """The residuals of this rank by name (``<bucket>.worker``, ``<bucket>.server``)."""
        return {f"{name}.{part}": t for name, state in self.feedback.items() for part, t in state.items()}

    def load_feedback_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Take residuals that `feedback_state` gave (the next reduction checks their sizes)."""
        names = {key.rpartition(".")[0] for key in saved}
        for name in names:
            self.feedback[name] = _BucketFeedback(saved[f"{name}.worker"], saved.get(f"{name}.server"))


class _BucketFeedback:
    """The error-feedback residuals of one DDP bucket on this rank: ``worker`` [P*m] (what this
    rank's encodings of its gradient have not delivered) and ``server`` [m] (the same for the
    all-gather of the shard it averages)."""

    __slots__ = ("worker", "server")

    def __init__(self, worker: torch.Tensor, server: torch.Tensor | None) -> None:
        self.worker, self.server = worker, server

    @classmethod
    def zeros(cls, padded: int, world: int, device) -> "_BucketFeedback":
        return cls(torch.zeros(padded, dtype=torch.float32, device=device),
                   torch.zeros(padded // world, dtype=torch.float32, device=device))

    def fits(self, padded: int, world: int, device) -> bool:
        """Whether these residuals belong to a bucket of ``padded`` values over ``world`` ranks."""
        return (self.worker.numel() == padded and self.worker.device == device and self.server is not None
                and self.server.numel() == padded // world)

    def items(self):
        return [("worker", self.worker), ("server", self.server)]


def feedback_average(xs: Sequence[torch.Tensor], workers: Sequence[torch.Tensor],
                     servers: Sequence[torch.Tensor] | None,
                     reduce_scatter: Callable[[list, list], list],
                     all_gather: Callable[[list, list], torch.Tensor] | None,
                     divide: float = 1.0):
    """The compressed gradient reduction with error feedback at both ends (module doc), for the
    ranks this process holds: one on a real group, every virtual rank of an `EmulatedGroup`.

    ``xs[i]``: rank i's flat fp32 gradient [P*m], used as scratch; ``workers[i]`` [P*m] and
    ``servers[i]`` [m]: its residuals, updated. ``reduce_scatter(xs, residuals)`` returns each
    rank's shard [m] of the sum of what was sent (a `comm` reduce-scatter with ``residual=``);
    ``all_gather(shards, residuals)`` the full [P*m] every rank receives (None: return the
    averaged shards, FSDP2's reduce-scatter). The shards are divided by ``divide`` (an average).

    Invariant, per rank and element: ``delivered + worker/P + server = true mean + previous
    residuals``, to fp32 rounding; summed over steps, nothing is lost.
    """
    for x, worker in zip(xs, workers):
        x.add_(worker)  # c = g + r: this step's gradient and what earlier steps did not deliver
    shards = reduce_scatter(list(xs), list(workers))  # sum of decode(sent); workers <- c - decode(sent)
    for shard in shards:
        shard.div_(divide)
    if all_gather is None:
        _keep_finite(workers)
        return shards
    for shard, server in zip(shards, servers):
        shard.add_(server)
    full = all_gather(shards, list(servers))  # servers <- shard + server - decode(sent)
    _keep_finite([*workers, *servers])
    return full


def _keep_finite(residuals: Sequence[torch.Tensor]) -> None:
    """A non-finite gradient is delivered as such (the step sees it), never carried further."""
    for r in residuals:
        torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)


class FsdpReduceScatter:
    """FSDP2's gradient reduce-scatter of one unit (``FSDPModule.set_custom_reduce_scatter``:
    FSDP2 calls it with its flat fp32 reduce-scatter input, the output shard, the dp group and
    the reduce op) through the compressed `comm.Site` ``site`` with a worker residual of the
    input's size (`feedback_average` without the all-gather). Duck-typed to torch's
    ``ReduceScatter`` interface (``allocate`` and ``__call__``), which is not public API."""

    def __init__(self, site: Site) -> None:
        self.site, self.residual = site, None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        world = self.site.world
        if dist.get_world_size(group) != world:
            raise RuntimeError(f"{self.site.name}: FSDP2 reduces over {dist.get_world_size(group)} ranks, the site's "
                               f"group has {world}")
        if op == dist.ReduceOp.AVG:
            divide = world
        elif op == dist.ReduceOp.SUM:
            divide = 1
        else:
            raise RuntimeError(f"{self.site.name}: FSDP2 asks for the reduce op {op}; the compressed gradient "
                               "reduction supports SUM and AVG (do not set a gradient divide factor with it)")
        x = input_tensor if input_tensor.dtype == torch.float32 else input_tensor.float()
        if self.residual is None or self.residual.numel() != x.numel() or self.residual.device != x.device:
            if self.residual is not None:
                logger.warning("%s: the gradient layout changed (%d values, was %d): its error-feedback residual "
                               "starts again from zero", self.site.name, x.numel(), self.residual.numel())
            self.residual = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        (shard,) = feedback_average(
            [x.view(-1)], [self.residual], None,
            lambda xs, lost: [self.site.run("reduce_scatter", xs[0].view(world, -1), residual=lost[0]).view(-1)],
            None, divide=divide)
        output_tensor.copy_(shard.view_as(output_tensor))
        return None


class FsdpGradCompression:
    """The compressed reduce-scatters of every FSDP2 unit of ``modules`` (`FsdpReduceScatter`,
    one site per unit: ``dp.grad.<unit>/reduce_scatter``), and their residuals."""

    def __init__(self, modules: list[nn.Module], stage_ids: list[int], sites: SiteTable):
        from torch.distributed.fsdp import FSDPModule

        self.comms: dict[str, FsdpReduceScatter] = {}
        for module, stage in zip(modules, stage_ids):
            for path, unit in module.named_modules():
                if isinstance(unit, FSDPModule):
                    name = f"{GRAD_SITE}.{_unit_name(path, stage)}"
                    comm = self.comms[name] = FsdpReduceScatter(sites.site(f"{name}/reduce_scatter"))
                    unit.set_custom_reduce_scatter(comm)

    def feedback_state(self) -> dict[str, torch.Tensor]:
        return {f"{name}.worker": c.residual for name, c in self.comms.items() if c.residual is not None}

    def load_feedback_state(self, saved: dict[str, torch.Tensor]) -> None:
        for key, value in saved.items():
            name = key.rpartition(".")[0]
            if name in self.comms:
                self.comms[name].residual = value


def _unit_name(path: str, stage: int) -> str:
    """An FSDP2 unit's site name: its transformers path (a pipeline stage's ``model.`` dropped),
    or ``stage<k>`` for a stage's root (embedding, final norm, head)."""
    if not path:
        return f"stage{stage}"
    return path[len("model."):] if path.startswith("model.model.") else path


def grad_sites(mesh: DeviceMesh, grad_compression: Compression, ledger: Ledger | None) -> SiteTable | None:
    """The sites of the compressed gradient reduction over ``mesh["dp"]`` (None when off or
    dp = 1), recording into ``ledger`` (the model's)."""
    if grad_compression.mode == "off" or mesh["dp"].size() == 1:
        return None
    return SiteTable(mesh["dp"].get_group(), grad_compression, timed=True, ledger=ledger)


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
        last = mesh["pp"].size() - 1  # pp = 1: no pair, no group
        self.group = pp_pair_groups(mesh, [(0, last)]).get(frozenset((0, last)))

    def __call__(self) -> None:
        if self.first is not None and self.last is not None:  # both on this rank
            self.first.grad.add_(self.last.grad)
            self.last.grad.copy_(self.first.grad)
        elif self.group is not None:
            p = self.first if self.first is not None else self.last
            if p is not None and p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=self.group)

