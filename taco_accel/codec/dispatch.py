"""Which implementation runs each codec operation: the one place that decides.

`select` picks a `Kernel` from the operation, the `TacoConfig`, the tensors' device, the wire
layout (for its size) and the `Tuning`; `compress_into`, `decompress_into` and `sum_into` run
it. The first row that matches wins (G = ``config.group_size``, groups = ``layout.num_groups``;
``rows_max_group`` and ``split_max_groups`` are `Tuning` fields)::

    backend       device and runtime                   op                    G and size                 runs
    ------------  -----------------------------------  --------------------  -------------------------  ------------
    torch         any                                  any                   any                        REFERENCE
    auto          not CUDA                             any                   any                        REFERENCE
    auto          CUDA, triton not installed           any                   any                        REFERENCE
    triton        triton not installed                 any                   any                        RuntimeError
    triton        not CUDA, TRITON_INTERPRET unset     any                   any                        RuntimeError
    auto, triton  CUDA on NVIDIA (not ROCm), compiled  compress              G = 128 <= rows_max_group, SPLIT_ROWS
                  (not interpreted), Gluon in triton                         groups <= split_max_groups
    auto, triton  the same                             compress, decompress  G <= rows_max_group, 128   ROWS
    auto, triton  any other: CUDA (ROCm, no Gluon), or the CPU under         any                        TILES
                  TRITON_INTERPRET=1; every sum; G = 256 and 512

- REFERENCE: `kernels.reference`, PyTorch ops (the specification; slow on a GPU).
- TILES: `kernels.triton_kernels`, tiles of groups with the transform on the tensor cores; runs
  anywhere Triton does, every group size.
- ROWS: `kernels.gluon_kernels`, one group per lane (a group's values must fit in one thread's
  registers: G <= 128). SPLIT_ROWS: the same encoder with a group of 128 over 2 lanes, and 4 in
  the kernel's first and last waves, for kernels of few waves (`Tuning`).

All write the same bytes, up to the rounding of values at a tie; ROWS and SPLIT_ROWS are the
fastest on NVIDIA GPUs where they apply. Gluon is experimental in triton and its API changes
between releases: when a ROWS or SPLIT_ROWS kernel fails to compile, that call runs TILES, one
warning names the kernel and the compiler's reason, and `failed_builds` records it, so its row
above no longer matches in this process (the next matching row does).
"""

from __future__ import annotations

import enum
import functools
import warnings

import torch

from .config import CodecConfig
from .kernels import interpreting, reference, sm_count
from .layout import WireLayout
from .tuning import Tuning

OPS = ("compress", "decompress", "sum")


class Kernel(enum.Enum):
    """An implementation of the codec's operations (rows of `select`'s table)."""

    REFERENCE = "reference"
    TILES = "triton tensor-core tiles"
    ROWS = "gluon, a group per lane"
    SPLIT_ROWS = "gluon, a group over 2-4 lanes"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this triton has the Gluon language the ROWS kernels are written in."""
    if not triton_available():
        return False
    from .kernels import gluon_kernels

    return gluon_kernels.AVAILABLE


# (kernel, op) -> the compiler's reason, for each Gluon kernel that failed to build in this process;
# `select` skips those (the fallback of the module docstring). Filled by `_run_gluon` only.
failed_builds: dict[tuple[Kernel, str], str] = {}


def select(op: str, config: CodecConfig, device: torch.device, layout: WireLayout, tuning: Tuning) -> Kernel:
    """The `Kernel` that runs ``op`` (``"compress"``, ``"decompress"`` or ``"sum"``) on tensors of
    ``device``: the table of the module docstring. Raises RuntimeError where ``config.backend``
    asks for something this machine cannot run."""
    if op not in OPS:
        raise ValueError(f"unknown codec operation {op!r}; use one of {OPS}")
    if config.backend == "torch" or (config.backend == "auto" and device.type != "cuda"):
        return Kernel.REFERENCE
    if not triton_available():
        if config.backend == "triton":
            raise RuntimeError("TacoConfig(backend='triton') needs the triton package: pip install triton")
        return Kernel.REFERENCE
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"TacoConfig(backend='triton') needs CUDA tensors (got {device.type}); use "
            "backend='auto' or 'torch', or set TRITON_INTERPRET=1 to run the kernels on the CPU"
        )
    rows = (op != "sum" and device.type == "cuda" and not interpreting() and torch.version.hip is None
            and gluon_available() and config.group_size <= min(tuning.rows_max_group, _rows_max_group()))
    if rows and op == "compress" and config.group_size == 128 and layout.num_groups <= tuning.split_max_groups:
        if (Kernel.SPLIT_ROWS, op) not in failed_builds:
            return Kernel.SPLIT_ROWS
    if rows and (Kernel.ROWS, op) not in failed_builds:
        return Kernel.ROWS
    return Kernel.TILES


def _rows_max_group() -> int:
    from .kernels import gluon_kernels

    return gluon_kernels.MAX_GROUP


def compress_into(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout, config: CodecConfig,
                  tuning: Tuning) -> None:
    """Encode the flat tensor ``x`` into ``buffer`` (uint8, ``layout.total_bytes``)."""
    kernel = select("compress", config, x.device, layout, tuning)
    if kernel is Kernel.REFERENCE:
        reference.compress_into(x, buffer, layout, config)
        return
    from .kernels import triton_kernels

    x = x.contiguous()
    if kernel in (Kernel.ROWS, Kernel.SPLIT_ROWS):
        from .kernels import gluon_kernels

        split_sms = sm_count(x.device) if kernel is Kernel.SPLIT_ROWS else 0
        if _run_gluon(kernel, "compress", gluon_kernels.compress_rows_into, x.view(-1), buffer, layout, config,
                      tuning, split_sms):
            return
    triton_kernels.compress_into(x, buffer, layout, config, tuning)


def decompress_into(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
                    tuning: Tuning) -> None:
    """Decode ``buffer`` into the flat contiguous tensor ``out`` (``layout.numel`` values)."""
    kernel = select("decompress", config, out.device, layout, tuning)
    if kernel is Kernel.REFERENCE:
        reference.decompress_into(buffer, layout, config, out)
        return
    from .kernels import triton_kernels

    if kernel is Kernel.ROWS:
        from .kernels import gluon_kernels

        if _run_gluon(kernel, "decompress", gluon_kernels.decompress_rows_into, buffer, layout, config, out, tuning):
            return
    triton_kernels.decompress_into(buffer, layout, config, out, tuning)


def sum_into(stacked: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
             tuning: Tuning) -> None:
    """Dequantise, sum and requantise the P buffers of ``stacked`` [P, total_bytes] into ``out``."""
    kernel = select("sum", config, stacked.device, layout, tuning)
    if kernel is Kernel.REFERENCE:
        reference.sum_into(stacked, layout, config, out)
        return
    from .kernels import triton_kernels

    triton_kernels.sum_into(stacked, layout, config, out, tuning)


def _run_gluon(kernel: Kernel, op: str, launch, *args) -> bool:
    """Run a Gluon launch; False if this triton cannot compile the kernel (recorded, with one
    warning: nothing was written yet, so the caller runs TILES instead)."""
    import triton

    try:
        launch(*args)
        return True
    except triton.compiler.errors.CompilationError as error:
        why = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        failed_builds[(kernel, op)] = why
        warnings.warn(
            f"taco_accel: the Gluon kernel for {op} ({kernel.value}) does not compile with triton "
            f"{triton.__version__}: {why}. {op} runs the tensor-core kernels (TILES) instead from now on; "
            "Gluon's API changes between triton releases, please report your triton version.",
            RuntimeWarning, stacklevel=4)
        return False
