"""The collectives as PyTorch custom ops, so that torch.compile keeps them in one graph.

    torch.ops.taco.all_reduce(x, route)              # same shape as x
    torch.ops.taco.all_gather(x, route, world)       # dim 0 times world
    torch.ops.taco.reduce_scatter(x, route, world)   # dim 0 divided by world

``route`` is the integer handle of a `site.Site` registered with `register` (it registers
itself); the op's body calls ``route.run(kind, x) -> Tensor``. Everything the call needs (the
group, the codec settings, the decision, the statistics) is the site's, in this layer: the op
calls nothing above it. Inside a compiled graph the op is opaque: its Python body runs at run
time, eagerly, so the codec settings, the auto decision, the per-site statistics and the error
sampling all stay outside the traced region and cost no graph break; the fake implementations
give the tracer the output shapes. Under CUDA graph capture the body runs once, at capture
(statistics then count the capture only). The ops return new tensors and mutate nothing.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_routes: dict[int, weakref.ref] = {}
_handles = itertools.count(1)


def register(route) -> int:
    """A handle for the site ``route`` (kept by weak reference: a dead site's handle raises)."""
    handle = next(_handles)
    _routes[handle] = weakref.ref(route, lambda _, h=handle: _routes.pop(h, None))
    return handle


def route(handle: int):
    found = _routes.get(handle)
    obj = found() if found is not None else None
    if obj is None:
        raise RuntimeError(f"taco collective route {handle} is gone (its model was deleted); rebuild the model")
    return obj


@torch.library.custom_op("taco::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, route_handle: int) -> torch.Tensor:
    """Sum over the route's group (`collectives.all_reduce`)."""
    return route(route_handle).run("all_reduce", x)


@all_reduce.register_fake
def _(x, route_handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("taco::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, route_handle: int, world: int) -> torch.Tensor:
    """Every rank's x concatenated along dim 0 (`collectives.all_gather`)."""
    return route(route_handle).run("all_gather", x)


@all_gather.register_fake
def _(x, route_handle, world):
    return x.new_empty((x.shape[0] * world, *x.shape[1:]))


@torch.library.custom_op("taco::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, route_handle: int, world: int) -> torch.Tensor:
    """This rank's rows of the sum (`collectives.reduce_scatter`)."""
    return route(route_handle).run("reduce_scatter", x)


@reduce_scatter.register_fake
def _(x, route_handle, world):
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))
