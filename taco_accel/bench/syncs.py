"""Host syncs: how often the host waits for the device in a region of code, and where.

    with HostSyncs(device, host=optimizer_host_state(optimizer)) as syncs:
        step()
    syncs.count, syncs.events      # [("read", "taco_accel/parallel/parts.py:190 clip_grad_norm_"), ...]

On CUDA it counts the warnings of torch.cuda's sync debug mode, which warns at every call that
makes the host wait for the device: a value read to the host (``.item()``, ``bool(t)``), a copy
to the host, a host-to-device copy from pageable memory, an op whose output size depends on the
values (``nonzero``, boolean indexing), a stream's synchronisation. An explicit
``torch.cuda.synchronize()`` is not counted (a device-wide wait the caller chose, as a bench's
timer does). Warnings raised in the autograd engine's device threads reach the caller when the
backward returns, so a backward's syncs count too.

Elsewhere (the CPU, where nothing waits) it counts what would wait if the CPU were the GPU: a
value read of a device tensor (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``),
a copy of one to the host (``.tolist()``, ``.cpu()``, ``.numpy()``), a blocking copy of host data
to the device (``torch.tensor(data, device=...)``, ``.to(device)`` of a host tensor without
``non_blocking``), and the ops whose output size depends on the values of a device tensor
(`VALUE_SIZED`, boolean indexing). Which tensors are the device's: those that exist when the
region starts (parameters, gradients, optimizer moments, a prepared batch), unless named in
``host`` (what lives on the host on a GPU too: a non-fused optimizer's step counts,
`optimizer_host_state`; the token stream batches are cut from), and those an op makes from one,
or a transfer or factory puts on the device; host data (``torch.tensor(list)``, a CPU collate) and
what is computed from it alone stay the host's, and reading them is free. It sees the dispatcher's
ops through a ``TorchDispatchMode`` and the transfers' Python entry points (``Tensor.to`` / ``cpu``
/ ``tolist`` / ``numpy``, ``torch.tensor`` / ``as_tensor`` and the factories taking ``device=``),
patched for the region: on a CPU tensor ``.tolist()`` reaches no dispatcher op. Under a dispatch
mode dynamo leaves functions uncompiled, so there the count is the eager program's.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# the message of torch.cuda.set_sync_debug_mode("warn") (c10/cuda/CUDAFunctions.cpp)
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

_aten = torch.ops.aten
# ops whose output's size is read from the values: each waits for the device on a GPU
VALUE_SIZED = frozenset({_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                         _aten.unique_consecutive.default, _aten.unique_dim.default})
_READS = frozenset({_aten._local_scalar_dense.default, _aten.equal.default})  # a value to the host
# factories that take a device= (the dispatcher sees the CPU's default and an explicit cpu alike)
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "randperm", "eye", "linspace")
_TORCH_ROOT = str(Path(torch.__file__).parent)
_HERE = __file__


class HostSyncs:
    """A context manager counting the host's waits for the device (see the module doc): ``count``,
    and ``events``, ``(kind, where)`` each (kind: ``"sync"`` on CUDA; elsewhere ``"read"``,
    ``"to_host"``, ``"to_device"`` or ``"value_sized"``). ``host``: tensors existing before the
    region that live on the host on a GPU too (read only where the device is not CUDA)."""

    def __init__(self, device: torch.device | str, host: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device)
        self.host = list(host)
        self.events: list[tuple[str, str]] = []
        self._inner = None

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self) -> HostSyncs:
        self.events = []
        self._inner = _CudaSyncs(self.events) if self.device.type == "cuda" else _Proxy(self.events, self.host)
        self._inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        inner, self._inner = self._inner, None
        inner.__exit__(*exc)


class _CudaSyncs:
    """The sync debug mode's warnings, recorded (every one: "always") as events."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __enter__(self) -> _CudaSyncs:
        self._mode = torch.cuda.get_sync_debug_mode()
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._caught.__exit__(*exc)
        self.events += [("sync", f"{_short(w.filename)}:{w.lineno}") for w in self._records
                        if CUDA_SYNC_WARNING in str(w.message)]


class _Proxy:
    """Where there is no device to wait for: what would wait if the CPU were the GPU (module doc)."""

    def __init__(self, events: list, host: list) -> None:
        self.events = events
        self._host: dict[int, weakref.ref] = {}  # host tensors, by id (a tensor's == is elementwise)
        self._device: dict[int, weakref.ref] = {}  # tensors made on the device in the region
        for t in host:
            self._mark(self._host, t)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Proxy:
        self._stack.enter_context(_Dispatch(self))
        self._patch(torch.Tensor, "to", self._to)
        for name in ("cpu", "tolist", "numpy"):
            self._patch(torch.Tensor, name, self._to_host)
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, self._from_data)
        for name in _FACTORIES:
            self._patch(torch, name, self._factory)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    # -- where tensors live -----------------------------------------------------------------------
    @staticmethod
    def _mark(table: dict, t: torch.Tensor) -> None:
        key = id(t)
        table[key] = weakref.ref(t, lambda _, key=key, table=table: table.pop(key, None))

    @staticmethod
    def _holds(table: dict, t: torch.Tensor) -> bool:
        ref = table.get(id(t))
        return ref is not None and ref() is t

    def on_device(self, t: torch.Tensor) -> bool:
        return self._holds(self._device, t) or not self._holds(self._host, t)

    def _set_place(self, t: torch.Tensor, device: bool) -> None:
        self._host.pop(id(t), None)
        self._device.pop(id(t), None)
        self._mark(self._device if device else self._host, t)

    def _record(self, kind: str) -> None:
        self.events.append((kind, _caller()))

    # -- the patched entry points -----------------------------------------------------------------
    def _patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._stack.callback(setattr, owner, name, original)

    def _to(self, original):
        def to(t, *args, **kwargs):
            parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to does not take it
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **parsed)
            out = original(t, *args, **kwargs)
            if device is not None:
                self._moved(t, out, torch.device(device), non_blocking)
            return out
        return to

    def _moved(self, t: torch.Tensor, out: torch.Tensor, target: torch.device, non_blocking: bool) -> None:
        to_device = target.type == "cpu"  # the stand-in for the device
        was_on_device = self.on_device(t)
        if t.numel() == 0:
            pass  # nothing to copy: torch returns before any copy or synchronisation
        elif to_device and not was_on_device and not non_blocking:
            self._record("to_device")
        elif not to_device and was_on_device:
            self._record("to_host")
        if out is not t:
            self._set_place(out, to_device)
        elif to_device:
            self._set_place(out, True)

    def _to_host(self, original):
        def read(t, *args, **kwargs):
            if self.on_device(t):
                self._record("to_host")
            return original(t, *args, **kwargs)
        return read

    def _from_data(self, original):
        def make(data, *args, **kwargs):
            out = original(data, *args, **kwargs)
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                if out.numel() and not (torch.is_tensor(data) and self.on_device(data)):
                    self._record("to_device")
                self._set_place(out, True)
            elif not (torch.is_tensor(data) and self.on_device(data)):
                self._set_place(out, False)
            return out
        return make

    def _factory(self, original):
        def make(*args, **kwargs):
            out = original(*args, **kwargs)
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                self._set_place(out, True)
            return out
        return make


class _Dispatch(TorchDispatchMode):
    """The dispatcher's side of `_Proxy`: value reads and value-sized ops of device tensors, and
    where each op's outputs live."""

    def __init__(self, syncs: _Proxy) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        syncs = self.syncs
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # lift_fresh: the tensor torch.tensor(data) made from host data, outside the dispatcher
        on_device = func is not _aten.lift_fresh.default and any(syncs.on_device(t) for t in inputs)
        if on_device and (func in _READS or func in VALUE_SIZED or _bool_index(func, args)):
            syncs._record("read" if func in _READS else "value_sized")
        # an op of a device tensor makes device tensors; of host ones (or of none), host ones
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]
        for t in [*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), *written]:
            syncs._set_place(t, on_device)
        return out


def _bool_index(func, args) -> bool:
    """``x[mask]``: an index op with a boolean index tensor (its output size is the mask's count)."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


def _caller() -> str:
    """``path:line function`` of the innermost frame outside torch, this module and any other
    dispatch mode's handler."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != _HERE and not frame.filename.startswith(_TORCH_ROOT) and frame.name != "__torch_dispatch__":
            return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def optimizer_host_state(optimizer) -> list[torch.Tensor]:
    """The state tensors torch keeps on the host (a non-fused, non-capturable optimizer's step
    counts, read with ``.item()`` every step at no device cost), for `HostSyncs`' ``host``."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    while hasattr(inner, "optimizer") and inner is not getattr(inner, "optimizer"):
        inner = inner.optimizer
    out = []
    for state in inner.state.values():
        step = state.get("step")
        if torch.is_tensor(step) and step.device.type == "cpu" and not any(
                group.get("fused") or group.get("capturable") for group in inner.param_groups):
            out.append(step)
    return out


def _short(path: str) -> str:
    return "/".join(Path(path).parts[-3:])


__all__ = ["CUDA_SYNC_WARNING", "HostSyncs", "VALUE_SIZED", "optimizer_host_state"]
