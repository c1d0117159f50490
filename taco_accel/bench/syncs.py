"""Host syncs: how often the host waits for the device in a region of code.

    with HostSyncs(device) as syncs:
        step()
    syncs.count

On CUDA it counts the warnings of torch.cuda's sync debug mode, which warns at every call that
makes the host wait for the device: a value read to the host (``.item()``, ``bool(t)``), a copy
to the host, a host-to-device copy from pageable memory, an op whose output size depends on the
values (``nonzero``, boolean indexing), a stream's synchronisation. An explicit
``torch.cuda.synchronize()`` is not counted (a device-wide wait the caller chose, as a bench's
timer does). Warnings raised in the autograd engine's device threads reach the caller when the
backward returns, so a backward's syncs count too.

Elsewhere (the CPU, where nothing waits) it counts what would wait on a GPU, through a dispatch
mode: reads of a value to the host (``aten._local_scalar_dense``), copies to the CPU from another
device, and the ops whose output size depends on the values (`VALUE_SIZED`). Under a dispatch mode
dynamo leaves functions uncompiled, so there the count is the eager program's.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the message of torch.cuda.set_sync_debug_mode("warn") (c10/cuda/CUDAFunctions.cpp)
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

_aten = torch.ops.aten
# ops whose output's size is read from the values: each waits for the device on a GPU
VALUE_SIZED = frozenset({_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                         _aten.unique_consecutive.default, _aten.unique_dim.default})


class HostSyncs:
    """A context manager counting the host's waits for the device (see the module doc) in ``count``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.count = 0
        self._inner = None

    def __enter__(self) -> HostSyncs:
        self.count = 0
        self._inner = _CudaSyncs() if self.device.type == "cuda" else _HostReads()
        self._inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        inner, self._inner = self._inner, None
        inner.__exit__(*exc)
        self.count = inner.count


class _CudaSyncs:
    """The sync debug mode's warnings, recorded (every one: "always") and counted."""

    def __enter__(self) -> _CudaSyncs:
        self.count = 0
        self._mode = torch.cuda.get_sync_debug_mode()
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._caught.__exit__(*exc)
        self.count = sum(CUDA_SYNC_WARNING in str(w.message) for w in self._records)


class _HostReads(TorchDispatchMode):
    """The ops that would make the host wait on a GPU (see the module doc), counted."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += _waits(func, args, kwargs)
        return func(*args, **kwargs)


def _waits(func, args, kwargs) -> bool:
    if func is _aten._local_scalar_dense.default or func in VALUE_SIZED:
        return True
    if func is _aten.index.Tensor:  # boolean-mask indexing: a nonzero inside
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func in (_aten._to_copy.default, _aten.copy_.default):  # to the CPU from another device
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        source = tensors[1] if func is _aten.copy_.default else tensors[0]
        target = (tensors[0].device if func is _aten.copy_.default
                  else torch.device(kwargs.get("device") or source.device))
        return target.type == "cpu" and source.device.type != "cpu"
    return False
