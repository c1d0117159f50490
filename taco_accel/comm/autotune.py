"""Does compression pay on this group? Time the plain and the compressed collective on a real message.

    timing = time_collective("all_reduce", x, group, config)   # a collective call: every rank
    timing.compress                                            # the same answer on every rank

TACO only pays when the wire time it saves beats the codec's time, and that depends on the
link, the message size and the GPU: no fixed size threshold is right everywhere. This module
measures instead: after one warm-up call of each (kernels compiled, buffers allocated), it
times ``reps`` calls of the plain collective (input dtype) and of the compressed one, alternating
them, on this very tensor, this group and this backend; each rank takes its median, then one
MAX all-reduce gives every rank the slowest rank's figures, so that all take the same decision
(a collective must not be compressed on one rank and plain on another). Compression is chosen
only when it is faster by more than ``margin`` (default 5%): never slower by default, within
the timing noise.

What to expect (`taco_accel.bench.projection`: H200 codec figures, assumed NCCL latencies;
1.5B-13B models at tp=8, 8192 tokens, 24-80 MiB bf16 all-reduces):

- NVLink / NVSwitch, NCCL's default NVLS all-reduce (the switch reduces; the compressed
  two-shot cannot, its scales differ per rank): plain is faster, the sites stay plain, the step
  is unchanged (always-on compression: 0.90-0.98x).
- NVLink with NCCL's ring (``NCCL_NVLS_ENABLE=0``, or no NVSwitch): compression wins by 15-20%
  on the larger messages in isolation, about 1% of the step.
- PCIe without NVLink (25-50 GB/s between GPUs): the wire dominates; every TP message is
  compressed, 1.6x on the step.
- TP across nodes (InfiniBand / RoCE, 25-50 GB/s per GPU): as PCIe, about 1.4x.

The decision times each collective alone; a backward all-reduce that `tp.overlap` hides behind
the weight-gradient matmuls costs less than that in the step, while the codec's kernels cannot
hide (they share the GPU): the model finds one case (13B, NVLink ring) where compressing is
0.99x of plain. Explicit ``"off"`` for a direction or site pins it.

The timing runs the collectives a few extra times (``2 + 2 * reps`` calls) once per distinct
message (kind, size, dtype, settings), during the first steps; warm up in eager mode before
capturing CUDA graphs (a timing syncs the device).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..codec import TacoConfig
from .collectives import run_collective

REPS = 3
MARGIN = 0.05


@dataclass(frozen=True)
class Timing:
    """Plain against compressed for one message on one group (seconds: the slowest rank's median)."""

    kind: str
    nbytes: int
    plain_s: float
    compressed_s: float
    compress: bool

    def to_dict(self) -> dict:
        return asdict(self)


def time_collective(
    kind: str, x: torch.Tensor, group, config: TacoConfig, reps: int = REPS, margin: float = MARGIN
) -> Timing:
    """Time ``kind`` ("all_reduce", "reduce_scatter", "all_gather") on ``x`` plain and compressed
    with ``config`` (its threshold ignored); a collective call, the same `Timing` on every rank."""
    x = x.detach().contiguous()
    world = dist.get_world_size(group)
    # no raise during a timing: a non-finite first step is for the real call to report
    cfg = config.replace(threshold_bytes=0, nonfinite="propagate" if config.nonfinite == "raise" else config.nonfinite)
    calls = (lambda: run_collective(kind, x, group, None), lambda: run_collective(kind, x, group, cfg))
    for call in calls:  # warm-up: Triton compilation, first allocations, connection set-up
        call()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for call, spent in zip(calls, times):
            spent.append(_seconds(call, x.device))
    medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64, device=x.device)
    if world > 1:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    plain_s, compressed_s = medians.tolist()
    return Timing(kind, x.numel() * x.element_size(), plain_s, compressed_s, compressed_s < plain_s * (1 - margin))


def _seconds(call, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
