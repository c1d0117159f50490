"""Compressed (TACO) against plain collectives: time, bus bandwidth and bytes on the wire.

    python -m taco_accel.bench.collectives                        # CPU: 2 gloo ranks, 1..64 MiB
    python -m taco_accel.bench.collectives --world-size 4 --sizes 1M,16M
    torchrun --nproc-per-node 8 -m taco_accel.bench.collectives   # GPUs: NCCL, 1 MiB..512 MiB
    python -m taco_accel.bench.collectives --stages               # codec stages on ONE device
    python -m taco_accel.bench.collectives --host                 # host us per call (see below)

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

``--host`` prints, in one run: (1) the host microseconds of a plain all-reduce with real
transfers, torch.distributed's own call beside `comm.all_reduce` and a layer-3 `comm.Site` (on a
GPU the time until the call returns, the transfer queued; on gloo the whole call); (2) one
all-reduce site call with the transfers and the codec kernels stubbed (the codec's dispatch
and header checks, and the collectives of `dist_ops.Link`, do nothing): the library's own host
us, collectives issued, Python calls, torch operations and tensors allocated, plain and
compressed; (3) that host work plus the measured cost of issuing each real collective the call
makes, compressed against plain; (4) the same site calls with real transfers and kernels (on a
GPU the host time until the call returns, and the CUDA caching allocator's allocations per
steady call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import comm
from ..codec import TacoConfig, WireLayout, compress, decompress, sum_packed
from ..codec.api import Packed
from ..comm import dist_ops
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
        pieces = int(args.piece_mib * MiB)
        seconds = _seconds_per_call(lambda: fn(x, None, cfg, site="bench", piece_bytes=pieces), device, args.budget,
                                    args.max_iters)
        figures = comm.pop_comm_stats()["bench"]
        error = same = None
        if cfg is not None:
            comm.set_error_sampling(1)
            out = fn(x, None, cfg, site="error", piece_bytes=pieces)
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
    config = TacoConfig(group_size=args.group_size, backend=args.codec_backend)
    rows = []
    for op in args.ops.split(","):
        for size in parse_sizes(args.sizes):
            rows += bench_one(op, size, config, args, device)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"# {world} ranks, {args.backend}, {args.dtype}, {config}, pieces {args.piece_mib:g} MiB, "
              f"torch {torch.__version__}")
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
    """Transfers and codec kernels replaced by no-ops (`dist_ops.Link`'s collectives, the codec's
    dispatch and its host-side header checks), everything else as it runs: what is left is the
    host work of a call, the device-side header comparison of every received chunk included (its
    flags not read at once: the stubbed transfers carry no headers). Counts the collectives a
    call would issue."""

    LINK = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "broadcast", "gather", "reduce")
    CODEC = ("compress_into", "decompress_into", "sum_into")

    def __init__(self) -> None:
        self.issued = 0
        self.saved = []

    def _issue(self, *args, **kwargs):
        self.issued += 1
        return dist_ops.DONE

    def __enter__(self):
        from ..codec import api, dispatch

        for name in self.LINK:
            self.saved.append((dist_ops.Link, name, getattr(dist_ops.Link, name)))
            setattr(dist_ops.Link, name, self._issue)
        for name in self.CODEC:
            self.saved.append((dispatch, name, getattr(dispatch, name)))
            setattr(dispatch, name, lambda *args, **kwargs: None)
        self.saved.append((api, "_check_wire_where_cheap", api._check_wire_where_cheap))
        api._check_wire_where_cheap = lambda *args, **kwargs: None
        self.saved.append((api, "READ_AT_ONCE", api.READ_AT_ONCE))
        api.READ_AT_ONCE = ()
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


class _Allocations(TorchDispatchMode):
    """Counts the tensors that the operations run under it allocate (an output whose storage no
    input had: views, in-place and ``out=`` operations allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        before = {t.untyped_storage().data_ptr() for t in tensors}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in before:
                self.count += 1
        return out


class _Calls:
    """Counts the Python-level calls (functions and builtins) one call makes."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.count += 1


def _interleaved(variants: dict, calls: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Host us per call of each variant: the variants take turns call by call (so that other work
    on the machine slows them alike), ``calls`` calls each per round; the best round's mean (the
    round least disturbed). On a GPU a call's time is until it returns, its work queued. Every
    rank runs the same calls."""
    names, fns = list(variants), list(variants.values())
    for fn in fns:  # warm-up: first-call checks, buffers, connections
        for _ in range(10):
            fn()
    best = dict.fromkeys(names, float("inf"))
    clock = time.perf_counter
    for _ in range(rounds):
        spent = [0.0] * len(fns)
        _sync(device)
        for _ in range(calls):
            for i, fn in enumerate(fns):
                start = clock()
                fn()
                spent[i] += clock() - start
        _sync(device)
        for name, seconds in zip(names, spent):
            best[name] = min(best[name], seconds / calls * 1e6)
    return best


def plain_times(numel: int, calls: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Host us per plain all-reduce, real transfers: torch.distributed's own call against
    `comm.all_reduce` and a layer-3 `comm.Site` (g), both in place as torch's is."""
    x = torch.zeros(numel, device=device)  # zeros: the sums stay finite call after call
    site = comm.Site("bench/plain", None, None)
    return _interleaved({
        "torch.distributed": lambda: dist.all_reduce(x),
        "comm.all_reduce": lambda: comm.all_reduce(x, inplace=True, site="bench/plain"),
        "Site": lambda: site.run("all_reduce", x, inplace=True),
    }, calls, rounds, device)


def real_costs(numel: int, calls: int, rounds: int, device: torch.device) -> dict[str, dict]:
    """Host us per all-reduce site call with real transfers and real codec kernels, plain and
    compressed, both in place (on a GPU: until the call returns, its kernels and transfers
    queued; on a CPU the reference codec's compute is in it), and on CUDA the blocks the caching
    allocator hands out during one steady call."""
    x = torch.zeros(numel, device=device)
    plain, packed = comm.Site("bench/real_plain", None, None), comm.Site("bench/real", None, TacoConfig())
    variants = {"plain": lambda: plain.run("all_reduce", x, inplace=True),
                "compressed": lambda: packed.run("all_reduce", x, inplace=True)}
    times = _interleaved(variants, calls, rounds, device)
    out = {}
    for name, fn in variants.items():
        allocations = None
        if device.type == "cuda":
            _sync(device)
            before = torch.cuda.memory_stats(device)["allocation.all.allocated"]
            fn()
            _sync(device)
            allocations = torch.cuda.memory_stats(device)["allocation.all.allocated"] - before
        out[name] = dict(us=times[name], allocations=allocations)
    comm.pop_comm_stats()
    return out


def own_costs(numel: int, calls: int, rounds: int, device: torch.device) -> dict[str, dict]:
    """Per call, transfers and codec kernels stubbed: host us, collectives issued, Python calls,
    torch operations and tensors allocated, for a plain and a compressed all-reduce site (in
    place, and into a new output), and the sequence-parallel overlap's per-rank kinds (`tp.overlap`:
    a gather of ``numel`` values per rank into the caller's buffer, landed part by part; a
    scatter of P parts of ``numel`` values, the caller's to keep, submitted one by one)."""
    x = torch.zeros(numel, device=device)
    plain, packed = comm.Site("bench/own_plain", None, None), comm.Site("bench/own", None, TacoConfig())
    world = dist.get_world_size()
    full = torch.zeros(world * numel, device=device)
    parts = [torch.zeros(numel, device=device) for _ in range(world)]

    def gather(site):
        parts_landed = site.gather_by_rank(x, out=full)
        for _ in parts_landed.landed():
            pass
        return parts_landed.wait()

    def scatter(site):
        sums = site.scatter_by_rank(x.shape, x.dtype, device)
        for rank, part in enumerate(parts):
            sums.submit(rank, part)
        return sums.wait()

    variants = {
        "plain, in place": lambda: plain.run("all_reduce", x, inplace=True),
        "compressed, in place": lambda: packed.run("all_reduce", x, inplace=True),
        "compressed, new output": lambda: packed.run("all_reduce", x),
        "SP gather by rank, plain": lambda: gather(plain),
        "SP gather by rank, compressed": lambda: gather(packed),
        "SP scatter by rank, plain": lambda: scatter(plain),
        "SP scatter by rank, compressed": lambda: scatter(packed),
    }
    for fn in variants.values():
        fn()  # the first call of each site: its agreement check needs the real transfers
    out = {}
    with _Stubbed() as stub:
        times = _interleaved(variants, calls, rounds, device)
        for name, fn in variants.items():
            stub.issued = 0
            fn()
            issued = stub.issued
            python = _Calls()
            sys.setprofile(python)
            fn()
            sys.setprofile(None)
            with TorchFunctionCount() as ops:
                fn()
            with _Allocations() as allocations:
                fn()
            out[name] = dict(us=times[name], collectives=issued, python=python.count, ops=ops.count,
                             allocations=allocations.count)
    for site in (plain, packed):
        site.record.header_flags.clear()  # the stubbed transfers delivered no headers
    comm.pop_comm_stats()
    return out


class TorchFunctionCount(TorchFunctionMode):
    """Counts the torch operations (tensor methods and functions) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def issue_us(numel: int, calls: int, device: torch.device) -> dict[str, float]:
    """Host us to issue one real asynchronous collective of each kind a call makes (its wait not
    counted), on `dist_ops.Link` as the library issues them: all-reduce of ``numel`` fp32 (plain),
    all-to-all and all-gather of the compressed bytes of one all-reduce (compressed)."""
    link = dist_ops.link(None)
    layout = WireLayout.for_tensor(numel, TacoConfig(), link.world)
    x = torch.zeros(numel, device=device)
    send = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    recv, mine = torch.empty_like(send), send[: layout.chunk_bytes]
    issue = {"all_reduce": lambda: link.all_reduce(x), "all_to_all": lambda: link.all_to_all(recv, send),
             "all_gather": lambda: link.all_gather(recv, mine)}
    out = {}
    for name, fn in issue.items():
        spent = []
        for i in range(calls + 10):
            _sync(device)
            start = time.perf_counter()
            work = fn()
            if i >= 10:
                spent.append(time.perf_counter() - start)
            work.wait()
        out[name] = min(spent) * 1e6
    return out


def agreement_us(calls: int, device: torch.device) -> float:
    """Us of one `comm.agreement.check` (the ranks' fingerprints compared: a real all-gather),
    what a site's first call, and every call under TACO_CHECK_COLLECTIVES=1, adds."""
    from ..comm import agreement

    x, link = torch.randn(1024, device=device), dist_ops.link(None)
    for _ in range(10):
        agreement.check("all_reduce", x.shape, x.dtype, x.device, link, None, False, "bench")
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        agreement.check("all_reduce", x.shape, x.dtype, x.device, link, None, False, "bench")
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def run_host(args) -> None:
    """Print the host tables of ``--host`` on rank 0 (every rank runs the calls)."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sizes = [int(n) for n in args.host_values.split(",")]
    plain = {n: plain_times(n, args.host_calls, args.host_rounds, device) for n in sizes}
    own = {n: own_costs(n, args.host_calls, args.host_rounds, device) for n in sizes}
    real_calls = args.host_calls if device.type == "cuda" else max(5, args.host_calls // 20)  # the CPU codec computes
    real = {n: real_costs(n, real_calls, args.host_rounds, device) for n in sizes}
    issue = {n: issue_us(n, args.host_calls, device) for n in sizes}
    check = agreement_us(args.host_calls // 5, device)
    if dist.get_rank() != 0:
        return
    head = (f"{dist.get_world_size()} ranks, {args.backend}, {device.type}, fp32, torch {torch.__version__}; "
            f"best of {args.host_rounds} rounds of {args.host_calls} calls")
    print(f"# plain all_reduce, real transfers: host us per call ({head})")
    print("| values | torch.distributed.all_reduce | comm.all_reduce(inplace=True) | Site (g, in place) | "
          "comm / torch | Site / torch |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, t in plain.items():
        ref = t["torch.distributed"]
        print(f"| {n} | {ref:.1f} | {t['comm.all_reduce']:.1f} | {t['Site']:.1f} | {t['comm.all_reduce'] / ref:.2f} | "
              f"{t['Site'] / ref:.2f} |")
    print(f"\n# one site call (all_reduce; the SP overlap's per-rank kinds), transfers and codec kernels stubbed: "
          f"the library's own host work ({head})")
    print("| values | call | host us | collectives | Python calls | torch ops | tensors allocated |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for n, rows in own.items():
        for name, r in rows.items():
            print(f"| {n} | {name} | {r['us']:.1f} | {r['collectives']} | {r['python']} | {r['ops']} | "
                  f"{r['allocations']} |")
    print(f"\n# host us per call with the issue cost of each real collective added ({head})")
    print("| values | issue all_reduce | issue all_to_all | issue all_gather | plain call | compressed call | "
          "compressed / plain |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        i, mine = issue[n], own[n]
        plain_call = mine["plain, in place"]["us"] + i["all_reduce"]
        packed_call = mine["compressed, in place"]["us"] + i["all_to_all"] + i["all_gather"]
        print(f"| {n} | {i['all_reduce']:.1f} | {i['all_to_all']:.1f} | {i['all_gather']:.1f} | {plain_call:.1f} | "
              f"{packed_call:.1f} | {packed_call / plain_call:.2f}x |")
    where = "until queued" if device.type == "cuda" else "whole call, the reference codec's compute included"
    print(f"\n# one all_reduce site call in place, real transfers and codec kernels: host us per call ({where}; {head})")
    print("| values | plain | compressed | compressed / plain | allocations plain / compressed |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for n, r in real.items():
        allocs = "n/a (CPU)" if r["plain"]["allocations"] is None else \
            f"{r['plain']['allocations']} / {r['compressed']['allocations']}"
        print(f"| {n} | {r['plain']['us']:.1f} | {r['compressed']['us']:.1f} | "
              f"{r['compressed']['us'] / r['plain']['us']:.2f}x | {allocs} |")
    print(f"\n# the ranks' agreement check (each site's first call; every call with TACO_CHECK_COLLECTIVES=1): "
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
    p.add_argument("--host", action="store_true", help="host us per call: plain against torch.distributed, "
                   "compressed against plain, allocations")
    p.add_argument("--host-calls", type=int, default=200, help="calls per round (--host)")
    p.add_argument("--host-rounds", type=int, default=9, help="rounds per figure, the best kept (--host)")
    p.add_argument("--host-values", default="1024,65536", help="fp32 values per all_reduce (--host)")
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
