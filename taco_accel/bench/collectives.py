"""Compressed (TACO) against plain collectives: time, bus bandwidth and bytes on the wire.

    python -m taco_accel.bench.collectives                        # CPU: 2 gloo ranks, 1..64 MiB
    python -m taco_accel.bench.collectives --world-size 4 --sizes 1M,16M
    torchrun --nproc-per-node 8 -m taco_accel.bench.collectives   # GPUs: NCCL, 1 MiB..512 MiB
    python -m taco_accel.bench.collectives --stages               # codec stages on ONE device
    python -m taco_accel.bench.collectives --host                 # host us per call, kernels stubbed

Sizes are message sizes in the chosen dtype, as in nccl-tests: the input of all_reduce, the
input (P blocks) of reduce_scatter, the output (P blocks) of all_gather. Bus bandwidth is
``size / time`` times 2(P-1)/P (all_reduce) or (P-1)/P (the others): for the compressed rows
it is the *effective* figure in uncompressed bytes, so it compares directly with plain.
"sent/rank" is what one rank actually put on the wire (from `pop_comm_stats`). Run as a
module without torchrun, it launches ``--world-size`` processes itself.

``--stages`` times, on one device with all inputs there, the codec work of one two-shot
all-reduce for P = 2, 4, 8: compress as P chunks, `sum_packed` over P received chunks,
decompress the whole result. "break-even" is the link bandwidth below which the bytes saved
pay for that codec time even without overlap.

``--host`` prints the host microseconds one call costs: the call timed with the codec kernels
and the transfers stubbed (the codec's dispatch and header checks, and the torch.distributed
calls, do nothing), plus the measured host cost of issuing one real async collective for each
collective the call makes. That is what the Python, the allocations and the launches of a call
cost, next to the plain collective's (on a GPU: before any kernel time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from .. import comm
from ..codec import TacoConfig, compress, decompress, sum_packed
from ..codec.api import Packed
from ..comm.pieces import PIECE_BYTES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("all_reduce", "reduce_scatter", "all_gather")
BUS_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}  # times (P-1)/P
HIDDEN = 1024  # row width of the benchmark tensors (a multiple of every group size)
MiB = 2**20


def parse_sizes(text: str) -> list[int]:
    """"1M,64M,1G" or "1,64" (MiB) -> bytes."""
    units = {"K": 2**10, "M": MiB, "G": 2**30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        sizes.append(int(float(item[:-1]) * units[item[-1]]) if item[-1] in units else int(float(item) * MiB))
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn, device: torch.device, budget_s: float, max_iters: int) -> float:
    """Mean seconds per call of ``fn`` after one warm-up, iterations fitted to ``budget_s``.

    The iteration count is agreed across ranks (a MAX all-reduce), so every rank makes the
    same calls.
    """
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    iters = torch.tensor([max(1, min(max_iters, int(budget_s / max(first, 1e-6))))], device=device)
    dist.all_reduce(iters, op=dist.ReduceOp.MAX)
    iters = int(iters.item())
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], device=device, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(elapsed.item())


def _input(op: str, size: int, world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The local input whose message (see module docstring) is about ``size`` bytes."""
    rows = max(world, size // (HIDDEN * dtype.itemsize))
    rows -= rows % world
    if op == "all_gather":
        rows //= world
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    return torch.randn(rows, HIDDEN, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)


def _same_on_all_ranks(out: torch.Tensor) -> bool:
    """Whether every rank holds the same bytes in ``out`` (a position-weighted checksum)."""
    word = torch.int16 if out.element_size() == 2 else torch.int32
    words = out.contiguous().view(-1).view(word).to(torch.int64)
    weights = torch.arange(words.numel(), device=out.device) % 65521 + 1
    check = torch.stack([words.sum(), (words * weights).sum()])
    low, high = -check.clone(), check.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(-low, high))


def _message_bytes(op: str, x: torch.Tensor, world: int) -> int:
    return x.numel() * x.element_size() * (world if op == "all_gather" else 1)


def bench_one(op: str, size: int, config: TacoConfig, args, device: torch.device) -> list[dict]:
    """Plain and compressed rows for one collective and size."""
    world = dist.get_world_size()
    x = _input(op, size, world, DTYPES[args.dtype], device)
    message = _message_bytes(op, x, world)
    fn = getattr(comm, op)
    rows = []
    for mode, cfg in (("plain", None), ("taco", config)):
        comm.pop_comm_stats()
        seconds = _seconds_per_call(lambda: fn(x, None, cfg, site="bench"), device, args.budget, args.max_iters)
        figures = comm.pop_comm_stats()["bench"]
        error = same = None
        if cfg is not None:
            comm.set_error_sampling(1)
            out = fn(x, None, cfg, site="error")
            error = comm.pop_comm_stats()["error"].error_mean
            comm.set_error_sampling(0)
            same = _same_on_all_ranks(out) if op != "reduce_scatter" else None
        algbw = message / seconds
        rows.append(dict(
            op=op, size=message, mode=mode, ms=seconds * 1e3, algbw=algbw / 1e9,
            busbw=algbw * BUS_FACTOR[op] * (world - 1) / world / 1e9,
            sent=figures.bytes_sent / figures.calls, error=error, same=same,
        ))
    rows[1]["speedup"] = rows[0]["ms"] / rows[1]["ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of `bench_one` rows."""
    lines = [
        "| op | size | mode | time ms | algbw GB/s | busbw GB/s | sent/rank MiB | speedup | rel err "
        "| same bytes |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        error = f"{r['error']:.4f}" if r["error"] is not None else ""
        same = {None: "", True: "yes", False: "NO"}[r["same"]]
        lines.append(
            f"| {r['op']} | {r['size'] / MiB:.4g} MiB | {r['mode']} | {r['ms']:.2f} | {r['algbw']:.2f} | "
            f"{r['busbw']:.2f} | {r['sent'] / MiB:.2f} | {speedup} | {error} | {same} |"
        )
    return "\n".join(lines)


def run_collectives(args) -> None:
    """The body of every rank: benchmark each op and size, print the table on rank 0."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    config = TacoConfig(
        threshold_bytes=0, piece_bytes=int(args.piece_mib * MiB), group_size=args.group_size,
        backend=args.codec_backend,
    )
    rows = []
    for op in args.ops.split(","):
        for size in parse_sizes(args.sizes):
            rows += bench_one(op, size, config, args, device)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"# {world} ranks, {args.backend}, {args.dtype}, {config}, torch {torch.__version__}")
        print(format_table(rows), flush=True)


def _spawned(rank: int, world: int, init_file: str, args) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # gloo may share one GPU
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        run_host(args) if args.host else run_collectives(args)
    finally:
        dist.destroy_process_group()


def launch(args) -> None:
    """Under torchrun: run here. Otherwise spawn ``--world-size`` local ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group(args.backend)
        try:
            run_host(args) if args.host else run_collectives(args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, os.path.join(tmp, "store"), args), nprocs=args.world_size)


# --- codec stages of one all-reduce on one device ---------------------------------------------


def _median_seconds(fn, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stage_times(
    numel: int, world: int, config: TacoConfig, dtype: torch.dtype, device: torch.device, reps: int
) -> dict:
    """Seconds of compress (P chunks), sum_packed (P inputs) and decompress for one all-reduce."""
    x = (torch.randn(numel, device=device) * 0.02).to(dtype)
    packed = compress(x, config, chunks=world)
    layout = packed.layout
    peers = torch.stack([compress(x.roll(p), config, chunks=world).buffer for p in range(world)])  # [P, total]
    stacked = peers.view(world, world, layout.chunk_bytes)[:, 0].contiguous()  # chunk 0 of each peer
    chunk = layout.chunk_layout()
    full = Packed(packed.buffer.clone(), x.shape, dtype, config, layout)
    out = torch.empty_like(x)
    return dict(
        compress=_median_seconds(lambda: compress(x, config, chunks=world), device, reps),
        sum=_median_seconds(lambda: sum_packed(stacked, chunk, config), device, reps),
        decompress=_median_seconds(lambda: decompress(full, out=out), device, reps),
        wire=2 * (world - 1) * layout.chunk_bytes,
        plain=2 * (world - 1) * numel * x.element_size() // world,
    )


def run_stages(args) -> None:
    """Print the codec stage table for P = 2, 4, 8 on one device."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # oversubscribed OpenMP threads distort CPU timings
    dtype = DTYPES[args.dtype]
    config = TacoConfig(group_size=args.group_size, backend=args.codec_backend)
    print(f"# codec stages of one all-reduce on {device}, {args.dtype}, {config}")
    print(
        "| size | P | compress ms | sum ms | decompress ms | codec ms | sent/rank MiB | saved MiB "
        "| break-even GB/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in parse_sizes(args.sizes):
        numel = size // dtype.itemsize
        for world in (2, 4, 8):
            t = stage_times(numel, world, config, dtype, device, args.reps)
            codec = t["compress"] + t["sum"] + t["decompress"]
            saved = t["plain"] - t["wire"]
            print(
                f"| {size / MiB:g} MiB | {world} | {t['compress'] * 1e3:.3f} | {t['sum'] * 1e3:.3f} | "
                f"{t['decompress'] * 1e3:.3f} | {codec * 1e3:.3f} | {t['wire'] / MiB:.2f} | "
                f"{saved / MiB:.2f} | {saved / codec / 1e9:.3g} |",
                flush=True,
            )


# --- host cost of one call --------------------------------------------------------------------


class _Stubbed:
    """Codec kernels and transfers replaced by no-ops (the codec's dispatch, its header checks,
    and the torch.distributed calls of `comm`), everything else as it runs; counts the
    collectives a call would issue."""

    def __init__(self) -> None:
        self.issued = 0
        self.saved = []

    def _issue(self, *args, **kwargs):
        self.issued += 1
        return _NoWait()

    def __enter__(self):
        from ..codec import api, dispatch
        from ..comm import collectives, compressed

        for module in (collectives, compressed):
            for name in ("all_reduce_", "all_gather_into", "reduce_scatter_into", "all_to_all"):
                if hasattr(module, name):
                    self.saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._issue)
        for name in ("compress_into", "decompress_into", "sum_into"):
            self.saved.append((dispatch, name, getattr(dispatch, name)))
            setattr(dispatch, name, lambda *args, **kwargs: None)
        self.saved.append((api, "_check_wire_where_cheap", api._check_wire_where_cheap))
        api._check_wire_where_cheap = lambda *args, **kwargs: None
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self.saved):
            setattr(module, name, original)


class _NoWait:
    def wait(self) -> bool:
        return True


def _issue_us(x: torch.Tensor, calls: int, device: torch.device) -> float:
    """Host us to issue one real async all_reduce (its wait not counted)."""
    spent = 0.0
    for i in range(calls + 10):
        _sync(device)
        start = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        if i >= 10:
            spent += time.perf_counter() - start
        work.wait()
    return spent / calls * 1e6


def host_times(numel: int, calls: int, device: torch.device) -> dict:
    """Host us per `comm.all_reduce` call, plain and compressed, kernels and transfers stubbed,
    with the issue cost of a real collective added once per collective the call makes."""
    x = torch.randn(numel, device=device)
    config = TacoConfig(threshold_bytes=0)
    issue = _issue_us(x, calls, device)

    def per_call(fn) -> tuple[float, int]:
        with _Stubbed() as stub:
            for _ in range(10):
                fn()
            stub.issued = 0
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            spent = time.perf_counter() - start
        return spent / calls * 1e6, stub.issued // calls

    plain, n_plain = per_call(lambda: comm.all_reduce(x, None, None))
    compressed, n_compressed = per_call(lambda: comm.all_reduce(x, None, config))
    comm.pop_comm_stats()
    return dict(issue=issue, own=(plain, compressed), plain=plain + n_plain * issue,
                compressed=compressed + n_compressed * issue, collectives=(n_plain, n_compressed))


def agreement_us(calls: int, device: torch.device) -> float:
    """Us of one `comm.agreement.check` (the ranks' fingerprints compared: a real all-gather),
    what a site's first call, and every call under TACO_CHECK_COLLECTIVES=1, adds."""
    from ..comm import agreement

    x, world = torch.randn(1024, device=device), dist.get_world_size()
    for _ in range(10):
        agreement.check("all_reduce", x, None, None, False, "bench", world)
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        agreement.check("all_reduce", x, None, None, False, "bench", world)
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def run_host(args) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rows = [(numel, host_times(numel, args.host_calls, device)) for numel in (1024, 65536)]
    check = agreement_us(args.host_calls, device)
    if dist.get_rank() == 0:
        print(f"# host us per all_reduce call, {dist.get_world_size()} ranks, {args.backend}, {device.type}, fp32, "
              f"codec kernels and transfers stubbed, plus the measured issue cost of each real collective; "
              f"mean of {args.host_calls} calls, torch {torch.__version__}")
        print("| values | issue one collective | taco_accel's own: plain / compressed | comm plain (collectives) | "
              "comm compressed (collectives) | compressed / plain |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for numel, t in rows:
            n_plain, n_compressed = t["collectives"]
            own_plain, own_compressed = t["own"]
            print(f"| {numel} | {t['issue']:.1f} | {own_plain:.1f} / {own_compressed:.1f} | {t['plain']:.1f} "
                  f"({n_plain}) | {t['compressed']:.1f} ({n_compressed}) | {t['compressed'] / t['plain']:.2f}x |",
                  flush=True)
        print(f"# the ranks' agreement check (each site's first call; every call with TACO_CHECK_COLLECTIVES=1): "
              f"{check:.0f} us", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m taco_accel.bench.collectives", description=__doc__.split("\n")[0]
    )
    p.add_argument("--sizes", default=None, help="message sizes, e.g. 1M,16M,512M (plain numbers: MiB)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="nccl" if gpu else "gloo")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the tensors live (default: cuda for nccl, cpu for gloo)")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count() if gpu else 2,
                   help="ranks of a local launch (ignored under torchrun)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--codec-backend", choices=("auto", "triton", "torch"), default="auto",
                   help="TacoConfig.backend: auto = Triton kernels on CUDA, reference on CPU")
    p.add_argument("--piece-mib", type=float, default=PIECE_BYTES / MiB,
                   help="pieces for overlap (0: off); default comm.pieces.PIECE_BYTES")
    p.add_argument("--budget", type=float, default=1.0 if gpu else 0.5, help="seconds of timed calls per row")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--stages", action="store_true", help="time the codec stages on one device instead")
    p.add_argument("--reps", type=int, default=20, help="repetitions per stage (--stages)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for --stages on a CPU")
    p.add_argument("--host", action="store_true", help="host us per call, kernels stubbed")
    p.add_argument("--host-calls", type=int, default=500, help="calls per figure (--host)")
    args = p.parse_args(argv)
    if args.sizes is None:
        if args.stages:
            args.sizes = "16M,64M,256M" if gpu else "1M"
        else:
            args.sizes = "1M,4M,16M,64M,256M,512M" if gpu else "1M,4M,16M,64M"
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    bad = [op for op in args.ops.split(",") if op not in OPS]
    if bad:
        p.error(f"--ops {bad} not in {OPS}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stages:
        run_stages(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
