"""The collectives as PyTorch custom ops, so that torch.compile keeps them in one graph.

    torch.ops.taco.all_reduce(x, handle, world)                    # a `site.Site`'s collective, one op
    torch.ops.taco.reduce_scatter(x, handle, world)                # per whole kind of `kinds.KINDS`
    torch.ops.taco.all_gather(x, handle, world)                    # (`OPS`, made from the registry)
    torch.ops.taco.emulated(xs, group_handle, site_handle, kind)   # an `emulated.EmulatedGroup`'s

A ``handle`` is the integer that `register` gives an object (a site, an emulated group) and
`find` turns back into it: a compiled graph holds integers, not Python objects. A site's handle
reaches its op as a 0-d int64 CPU tensor (`handle_tensor`, read on the host: no device sync): a
graph input, not a constant, so that one compiled graph serves every decoder block, each with
sites of its own (an int would be baked into the graph and guarded on: one recompile per block). The op's body
calls the object's eager method at run time (``site.run(kind, x)``,
``group.collective(kind, xs, site)``): everything the call needs (the group, the codec
settings, the decision, the statistics) is the object's, in this layer. Inside a compiled graph
the op is opaque, so the codec settings, the auto decision, the per-site statistics and the
error sampling stay outside the traced region and cost no graph break; the fake
implementations give the tracer the result's shape (`kinds.Kind.output_shape`). Under CUDA
graph capture the body runs once, at capture (statistics then count the capture only). The ops
return new tensors and mutate nothing.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .kinds import KINDS, Kind, kind_of

_registered: dict[int, weakref.ref] = {}
_handles = itertools.count(1)


def register(obj) -> int:
    """A new handle for ``obj`` (kept by weak reference: once ``obj`` is gone, `find` raises)."""
    handle = next(_handles)
    _registered[handle] = weakref.ref(obj, lambda _, h=handle: _registered.pop(h, None))
    return handle


def handle_tensor(handle: int) -> torch.Tensor:
    """``handle`` as a site's op takes it: a 0-d int64 tensor on the CPU."""
    return torch.tensor(handle, dtype=torch.int64)


def find(handle: int | torch.Tensor):
    """The object registered under ``handle``; a RuntimeError once it is gone."""
    handle = int(handle)
    found = _registered.get(handle)
    obj = found() if found is not None else None
    if obj is None:
        raise RuntimeError(f"taco collective handle {handle} is gone (its model was deleted); rebuild the model")
    return obj


def _site_op(kind: Kind):
    """The custom op ``taco::<kind>``: the collective of the site registered under ``handle``
    (`site.Site.run`), its result shaped by `kinds.Kind.output_shape` for the tracer."""
    name = kind.name

    @torch.library.custom_op(f"taco::{name}", mutates_args=())
    def op(x: torch.Tensor, handle: torch.Tensor, world: int) -> torch.Tensor:
        return find(handle).run(name, x)

    @op.register_fake
    def _(x, handle, world):
        return x.new_empty(kind.output_shape(x.shape, world))

    return op


OPS = {kind.name: _site_op(kind) for kind in KINDS.values() if not kind.per_rank}  # a compiled graph calls these


@torch.library.custom_op("taco::emulated", mutates_args=())
def emulated(xs: torch.Tensor, group_handle: int, site_handle: torch.Tensor, kind: str) -> torch.Tensor:
    """`emulated.EmulatedGroup.collective` of the stacked ``xs`` [P, ...] through a site."""
    return find(group_handle).collective(kind, xs, find(site_handle))


@emulated.register_fake
def _(xs, group_handle, site_handle, kind):
    described = kind_of(kind)
    if described.replicated:  # the one result every rank holds (all_gather: every rank's tensor, concatenated)
        return xs.new_empty(described.output_shape(xs.shape[1:], xs.shape[0]))
    return xs.new_empty(xs.shape[1:])  # every rank's rows of the sum, in rank order
