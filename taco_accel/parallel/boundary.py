"""Pipeline stage boundaries through the codec: the activations and activation gradients that
``torch.distributed.pipelining`` sends between stages, compressed like the TP collectives.

Boundary ``b`` lies between stage ``b`` and stage ``b + 1``. It has two sites, named so that the
patterns of `taco_accel.Compression` reach them:

- ``pp.<b>-<b+1>/fwd``: the hidden states stage b sends to stage b+1 (``Compression.forward``);
- ``pp.<b>-<b+1>/bwd``: their gradient, sent back (``Compression.backward``).

``"pp.*"`` matches every boundary; TP sites are named after modules (``layers.3.mlp.down_proj/fwd``,
``lm_head/bwd``) and data-parallel ones start with ``dp.``. ``sites={"pp.*": None}`` keeps the
boundaries plain while TP compresses; ``sites={"*": None, "pp.*": TacoConfig(...)}`` (the last
matching pattern wins) compresses the boundaries only.

How: every rank runs its stages as `BoundaryStage` s, a ``PipelineStage`` whose send and receive
operations (the ``P2POp`` s the schedules ask it for: ``get_fwd_send_ops`` and friends) carry the
wire buffer of a `comm.p2p.Channel` instead of the tensor when the site compresses, and which
decodes a received wire into the stage's own receive buffer before the forward or backward that
reads it. The schedules (GPipe, 1F1B, interleaved 1F1B) are unchanged and never see a compressed
value: they move uint8 buffers. Compression off, the very tensors the stage would send travel.
(An autograd function at the stage edges, encoding into a float view of the wire that the stage
returns, does not fit: the schedule sends the gradient of a stage input in that input's shape, so
a boundary's two directions would share one message size; the wire's size, and so an auto
decision, would have to be known before the first step's metadata inference fixes the shapes,
and that inference runs the stages on uninitialised inputs, which a decoder rejects; FSDP2's
mixed precision casts floating-point stage inputs, bits and all.)

Around the schedule (`PipelineRunner`, on every rank): `PipelineBoundaries.check` before the
first step compares each site's settings across its link (`comm.agreement`: a
`CollectiveMismatch` on both ends naming the site), and `PipelineBoundaries.settle` after every
step raises `NonFiniteError` on every rank if a boundary under ``nonfinite="raise"`` carried NaN
or Inf, and times the ``"auto"`` sites whose message no decision covered yet (they sent plain
meanwhile: the first step of a run). Each link has a process group of its two ranks for these
exchanges (the pp group itself when pp = 2).

The sites join the model's `tp.sites.SiteTable` (its ledger, its auto decisions, its
``decisions()``) when the model is tensor parallel, a table of their own otherwise
(`stage.site_tables`). `pipeline.emulate_boundaries` puts the same sites' codec round trip at the
stage cuts of a model run in one process (the convergence study's pipeline row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from ..comm.p2p import Channel
from ..errors import NonFiniteError
from ..comm.policy import Compression
from ..tp.sites import SiteTable
from .mesh import pp_pair_groups

logger = logging.getLogger(__name__)


def boundary_name(index: int) -> str:
    """The sites' prefix of boundary ``index`` (between stage index and index + 1): ``pp.0-1``."""
    return f"pp.{index}-{index + 1}"


@dataclass
class Boundary:
    """Boundary ``index`` seen from this rank: its forward and backward channels (this rank sends
    on ``fwd`` when it runs stage ``index``, on ``bwd`` when it runs stage ``index + 1``)."""

    index: int
    fwd: Channel
    bwd: Channel


class PipelineBoundaries:
    """The boundaries of this rank's stages and what runs around a schedule step; see the module
    docstring. ``raises``: some boundary of the pipeline (on any rank) has ``nonfinite="raise"``,
    so every rank joins the end-of-step check."""

    def __init__(self, boundaries: list[Boundary], num_stages: int, raises: bool, table: SiteTable) -> None:
        self.boundaries = sorted(boundaries, key=lambda b: b.index)
        self.num_stages, self.raises, self.table = num_stages, raises, table

    def channels(self) -> list[Channel]:
        """Every channel of this rank, in the order both ends of each link use (boundary, fwd, bwd)."""
        return [c for b in self.boundaries for c in (b.fwd, b.bwd)]

    def check(self, device: torch.device) -> None:
        """Compare each site's settings with its link's other end (first call; every call with
        ``TACO_CHECK_COLLECTIVES=1``). A collective of each link's two ranks."""
        for channel in self.channels():
            channel.check(device)

    def settle(self, device: torch.device) -> None:
        """After a schedule step: raise `NonFiniteError` on every rank for a non-finite message
        under ``"raise"`` (a collective over all ranks, only when ``raises``), then time the auto
        sites left undecided (collectives of each link's two ranks)."""
        if self.raises:
            self._raise_if_nonfinite(device)
        for channel in self.channels():
            channel.settle()

    def forget(self) -> None:
        for channel in self.channels():
            channel.forget()

    def _raise_if_nonfinite(self, device: torch.device) -> None:
        flags = torch.zeros(2 * max(self.num_stages - 1, 1), dtype=torch.int32, device=device)
        for b in self.boundaries:
            for k, channel in enumerate((b.fwd, b.bwd)):
                flag = channel.nonfinite() if channel.sends else None
                if flag is not None:
                    flags[2 * b.index + k] = flag.to(torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = [f"{boundary_name(i // 2)}/{('fwd', 'bwd')[i % 2]}" for i in flags.nonzero().flatten().tolist()]
        if bad:
            raise NonFiniteError(
                f"{', '.join(bad)}: a pipeline boundary carried NaN or Inf in this step (activations on /fwd, "
                "their gradients on /bwd; they travelled as zeros) under TacoConfig.nonfinite='raise'; find where "
                "the run diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
            )


def attach_boundaries(modules: list[nn.Module], stage_ids: list[int], num_stages: int, mesh: DeviceMesh,
                      compression: Compression, table: SiteTable | None) -> PipelineBoundaries:
    """Give each stage module of this rank its ``inbound`` / ``outbound`` `Boundary` (None where
    there is none, or the neighbour stage runs on this rank: no transfer) and every module the
    rank's `PipelineBoundaries` (``boundaries``). ``table``: the model's site table (None: one of
    the boundaries' own). A collective on every rank (`mesh.pp_pair_groups`: each link's group)."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    table = table or SiteTable(None, compression)
    groups = pp_pair_groups(mesh, [(b % pp, (b + 1) % pp) for b in range(num_stages - 1)])
    mine = set(stage_ids)

    def boundary(index: int, sender: bool) -> Boundary:
        group = groups[frozenset((index % pp, (index + 1) % pp))]
        name = boundary_name(index)
        return Boundary(index, Channel(table.site(f"{name}/fwd", group), sender),
                        Channel(table.site(f"{name}/bwd", group), not sender))

    found = []
    for s, module in zip(stage_ids, modules):
        module.inbound = boundary(s - 1, sender=False) if s > 0 and s - 1 not in mine else None
        module.outbound = boundary(s, sender=True) if s < num_stages - 1 and s + 1 not in mine else None
        found += [b for b in (module.inbound, module.outbound) if b is not None]
    raises = any(config is not None and config.nonfinite == "raise"
                 for b in range(num_stages - 1) for d in ("fwd", "bwd")
                 for config in [table.compression.config_for(f"{boundary_name(b)}/{d}")])
    boundaries = PipelineBoundaries(found, num_stages, raises, table)
    for module in modules:
        module.boundaries = boundaries
    if found:
        logger.info("pipeline boundaries of pp rank %d: %s", pp_rank,
                    ", ".join(f"{c.name} ({c.site.describe()})" for c in boundaries.channels()))
    return boundaries


def _through(channel: Channel | None, ops: list, chunk: int) -> list:
    """``ops`` with the tensors ``channel`` sends or receives in place of the stage's own."""
    if channel is None:
        return ops
    out = []
    for k, op in enumerate(ops):
        slot = (chunk, k)
        tensor = channel.outgoing(op.tensor, slot) if channel.sends else channel.incoming(op.tensor, slot)
        out.append(op if tensor is op.tensor else dist.P2POp(op.op, tensor, op.peer, op.group, op.tag))
    return out


def _land(channel: Channel | None, chunk: int, count: int) -> None:
    if channel is not None:
        for k in range(count):
            channel.land((chunk, k))


class BoundaryStage(PipelineStage):
    """A ``PipelineStage`` whose transfers to other ranks go through its boundaries' channels
    (``inbound``: from the previous stage, ``outbound``: to the next; None: no transfer there).

    Only the operations the schedules ask for are changed: each send carries what the channel
    sends (the tensor, or its wire buffer), each receive lands in what the channel receives into,
    and `forward_one_chunk` / `backward_one_chunk` first decode what arrived for that micro-batch
    into the buffers the base class reads.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, group=None,
                 inbound: Boundary | None = None, outbound: Boundary | None = None) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.inbound, self.outbound = inbound, outbound
        self._received: dict[tuple[str, int], int] = {}  # (direction, chunk) -> receives changed

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return _through(self.outbound and self.outbound.fwd, super().get_fwd_send_ops(fwd_chunk_id), fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return _through(self.inbound and self.inbound.bwd, super().get_bwd_send_ops(bwd_chunk_id), bwd_chunk_id)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self._received["fwd", fwd_chunk_id] = len(ops)
        return _through(self.inbound and self.inbound.fwd, ops, fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self._received["bwd", bwd_chunk_id] = len(ops)
        return _through(self.outbound and self.outbound.bwd, ops, bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        _land(self.inbound and self.inbound.fwd, fwd_chunk_id, self._received.pop(("fwd", fwd_chunk_id), 0))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        _land(self.outbound and self.outbound.bwd, bwd_chunk_id, self._received.pop(("bwd", bwd_chunk_id), 0))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._received.clear()
        for b in (self.inbound, self.outbound):
            if b is not None:
                b.fwd.forget()
                b.bwd.forget()
