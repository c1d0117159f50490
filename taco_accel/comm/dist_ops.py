"""Thin wrappers over torch.distributed: the one place for version and backend differences.

- torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
  ``all_gather_single`` / ``reduce_scatter_single``; we support torch>=2.6, so we bind
  whichever exists (no FutureWarning on new versions, no AttributeError on old ones).
- ``all_to_all_single`` exists on NCCL and on gloo (CPU and CUDA tensors) for every torch we
  support; a backend that refuses it (it raises before any byte moves, on every rank alike)
  gets the same exchange as P-1 isend/irecv pairs, `all_to_all_p2p`.

Every function takes an explicit ``group`` (None: the default group; `group_size` and
`group_rank` also answer without torch.distributed, as one rank) and, where it can run
asynchronously, returns a work handle whose ``wait()`` must be called before the output is
read (on NCCL, ``wait()`` only makes the current CUDA stream wait: no host sync).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_no_native_all_to_all: set[str] = set()  # backends seen refusing all_to_all_single
_backends: dict = {}  # process group (None: the default one) -> its backend name, looked up once


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


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group=None):
    """out [P*n] <- every rank's x [n] in rank order; returns a work handle."""
    return _all_gather_single(out, x, group=group, async_op=True)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """out [n] <- this rank's block of the sum over ranks of x [P*n]; a work handle if ``async_op``."""
    return _reduce_scatter_single(out, x, group=group, async_op=async_op)


def all_reduce_(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """x <- op over the ranks of x, in place; a work handle if ``async_op``."""
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def all_to_all(out: torch.Tensor, x: torch.Tensor, group=None):
    """out [P*n] <- block r of every rank's x [P*n], in rank order; returns a work handle.

    Rank r receives block r of each peer: out[p*n:(p+1)*n] = x_p[r*n:(r+1)*n].
    """
    backend = _backends.get(group)
    if backend is None:
        backend = _backends[group] = str(dist.get_backend(group))
    if backend not in _no_native_all_to_all:
        try:
            return dist.all_to_all_single(out, x, group=group, async_op=True)
        except (RuntimeError, NotImplementedError) as err:
            if "support" not in str(err).lower():
                raise
            _no_native_all_to_all.add(backend)
            logger.info("backend %s has no all_to_all_single (%s); using isend/irecv pairs", backend, err)
    return all_to_all_p2p(out, x, group)


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
    return _AllOf(dist.batch_isend_irecv(ops)) if ops else Done()


class _AllOf:
    """One handle for several works: ``wait()`` waits for all of them."""

    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True
