"""Thin wrappers over torch.distributed: the one place for version and backend differences.

- `Link` is one process group's collectives, issued straight on its ``ProcessGroup`` with the
  options built once: torch.distributed's functions re-check their arguments, resolve the group
  and build new options on every call (a few microseconds of host time each, as much as the rest
  of a plain call of ours). The methods are those torch.distributed's own functions call
  (``allreduce``, ``all_gather_single`` / ``_allgather_base``, ``reduce_scatter_single`` /
  ``_reduce_scatter_base``, ``all_to_all_single`` / ``alltoall_base``: torch 2.13 renamed them;
  we support torch>=2.6 and bind whichever exists).
- ``all_to_all_single`` exists on NCCL and on gloo (CPU and CUDA tensors) for every torch we
  support; a backend that refuses it (it raises before any byte moves, on every rank alike)
  gets the same exchange as P-1 isend/irecv pairs, `all_to_all_p2p`.

Every function takes an explicit ``group`` (None: the default group; `group_size` and
`group_rank` also answer without torch.distributed, as one rank) and returns a work handle
whose ``wait()`` must be called before the output is read (on NCCL, ``wait()`` only makes the
current CUDA stream wait: no host sync).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .copies import SharedWithCopies

logger = logging.getLogger(__name__)

_no_native_all_to_all: set[str] = set()  # backends seen refusing all_to_all_single


def group_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


class Done:
    """A finished work handle (for paths that complete synchronously)."""

    def wait(self) -> bool:
        return True


DONE = Done()


def _options(cls, **fields):
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if hasattr(opts, "asyncOp"):  # torch >= 2.9: the handle is waited on explicitly
        opts.asyncOp = True
    return opts


class Link(SharedWithCopies):
    """The collectives of one process group, each returning a work handle (``async_op=True``).

    Built once per group (`link`); holds the ``ProcessGroup`` by weak reference (the cache of
    links, and the workspaces a link owns, go with the group: `destroy_process_group`), its size
    and this rank's index in it, the options of every call, and ``workspaces``: the reused
    buffers of the compressed calls on this group, per device (`compressed.acquire`).
    """

    __slots__ = ("_pg", "_default", "world", "rank", "backend", "_sum", "_max", "_gather", "_scatter", "_a2a",
                 "_all_gather", "_reduce_scatter", "_all_to_all", "_broadcast", "_gather_to", "_reduce_to",
                 "workspaces", "__weakref__")

    def __init__(self, group) -> None:
        pg = dist.group.WORLD if group is None else group
        world = dist.get_world_size(group)
        if world < 1:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the group; call collectives on its members only"
            )
        self._pg, self._default = weakref.ref(pg), group is None
        self.world, self.rank = world, dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.workspaces: dict = {}  # torch.device -> compressed.Workspace
        self._sum = _options(c10d.AllreduceOptions, reduceOp=dist.ReduceOp.SUM)
        self._max = _options(c10d.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)
        self._gather = _options(c10d.AllgatherOptions)
        self._scatter = _options(c10d.ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)
        self._a2a = _options(c10d.AllToAllOptions)
        kind = type(pg)  # unbound: a bound method would hold the group
        self._all_gather = getattr(kind, "all_gather_single", None) or kind._allgather_base
        self._reduce_scatter = getattr(kind, "reduce_scatter_single", None) or kind._reduce_scatter_base
        self._all_to_all = getattr(kind, "all_to_all_single", None) or kind.alltoall_base
        roots = range(world)  # the rooted collectives of the per-rank kinds, one options object per root
        self._broadcast = [_options(c10d.BroadcastOptions, rootRank=r) for r in roots]
        self._gather_to = [_options(c10d.GatherOptions, rootRank=r) for r in roots]
        self._reduce_to = [_options(c10d.ReduceOptions, rootRank=r, reduceOp=dist.ReduceOp.SUM) for r in roots]

    @property
    def pg(self):
        """The ``ProcessGroup`` (an error once it was destroyed)."""
        pg = self._pg()
        if pg is None:
            raise RuntimeError("this process group was destroyed (destroy_process_group); build the model's groups "
                               "again before calling its collectives")
        return pg

    @property
    def group(self):
        """The group as torch.distributed's functions take it (None: the default group)."""
        return None if self._default else self.pg

    def all_reduce(self, x: torch.Tensor, op: str = "sum"):
        """x <- the sum (or ``op="max"``) over the ranks of x, in place."""
        return self.pg.allreduce([x], self._sum if op == "sum" else self._max)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor):
        """out [P*n] <- every rank's x [n] in rank order."""
        return self._all_gather(self.pg, out, x, self._gather)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor):
        """out [n] <- this rank's block of the sum over ranks of x [P*n]."""
        return self._reduce_scatter(self.pg, out, x, self._scatter)

    def broadcast(self, x: torch.Tensor, root: int):
        """x <- rank ``root``'s x (group rank)."""
        return self.pg.broadcast([x], self._broadcast[root])

    def gather(self, out: list[torch.Tensor] | None, x: torch.Tensor, root: int):
        """On rank ``root``: out[p] <- rank p's x (``out``: P tensors of x's size); elsewhere ``out``
        is None."""
        return self.pg.gather([out] if out is not None else [], [x], self._gather_to[root])

    def reduce(self, x: torch.Tensor, root: int):
        """On rank ``root``: x <- the sum over ranks of x (elsewhere x may be overwritten: scratch)."""
        return self.pg.reduce([x], self._reduce_to[root])

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor):
        """out [P*n] <- block r of every rank's x [P*n], in rank order (r: this rank):
        out[p*n:(p+1)*n] = x_p[r*n:(r+1)*n]."""
        if self.backend not in _no_native_all_to_all:
            try:
                return self._all_to_all(self.pg, out, x, [], [], self._a2a)
            except (RuntimeError, NotImplementedError) as err:
                if "support" not in str(err).lower():
                    raise
                _no_native_all_to_all.add(self.backend)
                logger.info("backend %s has no all_to_all_single (%s); using isend/irecv pairs", self.backend, err)
        return all_to_all_p2p(out, x, self.group)


_links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ProcessGroup -> Link, gone with the group


def link(group=None) -> Link:
    """The `Link` of ``group`` (None: the default group), built on first use."""
    pg = dist.group.WORLD if group is None else group
    found = _links.get(pg)
    if found is None:
        found = _links[pg] = Link(group)
    return found


def all_to_all_p2p(out: torch.Tensor, x: torch.Tensor, group=None):
    """`all_to_all` as P-1 isend/irecv pairs plus a local copy; returns a work handle."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    send, recv = x.view(world, -1), out.view(world, -1)  # [P, n]
    recv[rank].copy_(send[rank])
    ops = []
    for peer in range(world):
        if peer != rank:
            global_peer = dist.get_global_rank(group, peer) if group is not None else peer
            ops.append(dist.P2POp(dist.isend, send[peer], global_peer, group))
            ops.append(dist.P2POp(dist.irecv, recv[peer], global_peer, group))
    return _AllOf(dist.batch_isend_irecv(ops)) if ops else DONE


class _AllOf:
    """One handle for several works: ``wait()`` waits for all of them."""

    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True
