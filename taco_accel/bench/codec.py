"""Codec throughput: fused Triton kernels against the same steps as separate PyTorch ops.

    python -m taco_accel.bench.codec                 # CUDA: check, sweep kernel variants, time
    python -m taco_accel.bench.codec --check         # CUDA: the kernels against the reference only
    python -m taco_accel.bench.codec --sizes 1M,16M --group-sizes 128 --no-sweep

Prints GB/s (bytes read + bytes written over the median time) and that figure as a fraction
of the measured device copy bandwidth, for compress, decompress and dequant-sum-requant
(P inputs), Triton next to the PyTorch reference run on the same device. On a machine without
CUDA it runs the reference on the CPU only (figures for orientation, no kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import torch

from ..codec import Launch, Packed, TacoConfig, Tuning, WireLayout, compress, decompress, sum_packed
from ..codec.tuning import STEPS, DotMode, Store

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only figures need no kernels
    triton = None

if triton is not None:

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(y_ptr.dtype.element_ty), mask=mask)


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def timer(fn, device: torch.device, warmup: int = 3, reps: int = 20, graph: bool = True) -> float:
    """Median seconds of ``fn()``.

    On CUDA: replays of a CUDA graph by default (device time without the host's launch
    overhead), or plain launches timed with events (``graph=False``: what a caller sees when
    the host cannot run ahead of the device). On the CPU: perf_counter.
    """
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            try:
                return do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3
            except Exception:  # not capturable: fall back to plain launches
                torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, numel: int | None = None, dtype: torch.dtype = torch.float32,
                   graph: bool = False) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    The reference figure: 1 GiB of fp32 (64 MiB on the CPU), plain launches. With ``numel``,
    ``dtype`` and ``graph=True``: the copy at a kernel's own size, timed like the kernels (at
    small sizes launch and tail take a share that no kernel avoids)."""
    numel = numel or (2**28 if device.type == "cuda" else 2**24)
    x = torch.randn(numel, device=device).to(dtype)
    out = torch.empty_like(x)
    return 2 * numel * x.element_size() / timer(lambda: out.copy_(x), device, graph=graph)


def cast_bandwidth(device: torch.device, src: torch.dtype, dst: torch.dtype, n: int = 2**28) -> float:
    """Bytes/s (read + write) of a plain Triton cast ``src -> dst``, graph-timed: what the memory
    gives a stream with a kernel's read:write ratio and no arithmetic (bf16 -> fp8 is compress's
    traffic, fp8 -> bf16 decompress's). torch's own fp8 casts are far slower, so they are no
    ceiling."""
    x = torch.randn(n, device=device).to(src)
    out = torch.empty(n, device=device, dtype=dst)
    block = 8192
    seconds = timer(lambda: _cast_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=8), device)
    return n * (x.element_size() + out.element_size()) / seconds


class Rotating:
    """Several input sets used in turn, so repeated timings do not run out of the L2 cache."""

    def __init__(self, make, total_bytes_each: int, device: torch.device):
        count = 1 if device.type != "cuda" else max(1, min(8, (256 * 2**20) // max(total_bytes_each, 1)))
        self.items = [make() for _ in range(count)]
        self.cycle = itertools.cycle(range(count))

    def next(self):
        return self.items[next(self.cycle)]


def bench_case(numel: int, config: TacoConfig, dtype: torch.dtype, device: torch.device, peers: tuple,
               backends: tuple | None = None, eager: bool = True, tuning: Tuning = Tuning()) -> list[dict]:
    """Time compress / decompress / sum(P) for one size and config (both backends by default),
    the kernels launched with ``tuning``; ``eager``: also time plain launches (``eager`` seconds,
    else None)."""
    rows = []
    elem = torch.finfo(dtype).bits // 8
    backends = backends or (("triton", "torch") if device.type == "cuda" else ("torch",))
    wire = WireLayout.for_tensor(numel, config).total_bytes

    def row(step: str, backend: str, nbytes: int, fn) -> dict:
        seconds = timer(fn, device)
        eager_s = timer(fn, device, graph=False) if eager else None
        return dict(step=step, backend=backend, bytes=nbytes, seconds=seconds, eager=eager_s)

    for backend in backends:
        cfg = config.replace(backend=backend)
        xs = Rotating(lambda: torch.randn(numel, device=device, dtype=dtype) * 0.02, numel * elem, device)
        rows.append(row("compress", backend, numel * elem + wire, lambda: compress(xs.next(), cfg, tuning=tuning)))
        packs = Rotating(lambda: compress(torch.randn(numel, device=device, dtype=dtype), cfg), wire, device)
        out = torch.empty(numel, device=device, dtype=dtype)
        rows.append(row("decompress", backend, numel * elem + wire,
                        lambda: decompress(packs.next(), out, tuning=tuning)))
        layout = WireLayout.for_tensor(numel, cfg)
        for p in peers:
            stacks = Rotating(
                lambda: torch.stack([compress(torch.randn(numel, device=device, dtype=dtype), cfg).buffer for _ in range(p)]),
                wire * p, device,
            )
            rows.append(row(f"sum P={p}", backend, (p + 1) * wire,
                            lambda: sum_packed(stacks.next(), layout, cfg, tuning=tuning)))
    return rows


# The codec's variants by name: each sets the flags of one code path in the kernels.
VARIANTS = {
    "default": {},
    "dual": dict(scales="dual"),
    "dual-no-adaptive": dict(scales="dual", adaptive_scale=False),
    "no-hadamard": dict(hadamard=False),
    "int8": dict(format="int8"),
    "e5m2": dict(format="e5m2"),
    "signs": dict(random_signs=True),
}
# One (group size, variant, input dtype) per code path of the kernels, not their grid (each
# point a compiled specialisation on a GPU): every group size (the tile kernels' transform takes
# 1, 2, 4 or 8 sub-blocks at G = 32/64, 128, 256, 512; on an NVIDIA GPU G <= 128 runs the Gluon
# kernels), every variant at G = 128, the flags that enter the transform (no Hadamard, signs)
# also at other sub-block counts, every payload format through the tile decoder's payload
# products (G >= 256), every input dtype at several of them. tests/test_triton_kernels.py runs
# the same cases.
CHECK_CASES = (
    (32, "default", "fp32"), (64, "default", "bf16"), (128, "default", "fp16"), (256, "default", "bf16"),
    (512, "default", "fp32"), (128, "dual", "bf16"), (128, "dual-no-adaptive", "fp32"), (128, "int8", "bf16"),
    (128, "e5m2", "fp16"), (128, "no-hadamard", "bf16"), (128, "signs", "fp32"), (32, "signs", "fp16"),
    (64, "no-hadamard", "fp32"), (256, "no-hadamard", "fp16"), (512, "signs", "bf16"), (256, "int8", "fp32"),
    (512, "e5m2", "fp16"),
)


def check_case(index: int, device: str, tuning: Tuning, with_sum: bool) -> tuple[str, bool]:
    """Case ``index`` of `CHECK_CASES` (launched with ``tuning``) against the reference on
    ``device``: payload agreement, scales, decoded values and, ``with_sum``, the sum of 4 inputs.
    Returns the report line and whether it failed."""
    g, variant, dname = CHECK_CASES[index]
    kw, dtype = VARIANTS[variant], DTYPES[dname]
    ref = TacoConfig(group_size=g, backend="torch", **kw)
    tri = ref.replace(backend="triton")
    gen = torch.Generator(device).manual_seed(index)  # the same input wherever the case runs
    x = torch.randn(7, 4099, device=device, generator=gen)
    x = (x * torch.logspace(-3, 1, 7, device=device)[:, None]).to(dtype)
    pr, pt = compress(x, ref, chunks=3), compress(x, tri, chunks=3, tuning=tuning)
    lay = pr.layout
    qr = lay.payload(pr.buffer, ref.format).float()
    qt = lay.payload(pt.buffer, ref.format).float()
    mism = (qr != qt).float().mean().item()
    sr, st = lay.scales(pr.buffer), lay.scales(pt.buffer)
    srel = ((sr - st).abs() / sr.abs().clamp_min(1e-30)).max().item()
    dr = decompress(pr).float()
    dt = decompress(Packed(pr.buffer, pr.shape, pr.dtype, tri, pr.layout), tuning=tuning).float()
    drel = ((dr - dt).norm() / dr.norm()).item()
    smis = 0.0
    if with_sum:
        stacked = torch.stack([compress(x * (i + 1), ref).buffer for i in range(4)])
        one = WireLayout.for_tensor(x.numel(), ref)
        s_r, s_t = sum_packed(stacked, one, ref), sum_packed(stacked, one, tri, tuning=tuning)
        smis = (one.payload(s_r, ref.format).float() != one.payload(s_t, ref.format).float()).float().mean().item()
    # FP8 ties may round the other way in a few values (payload, sum); scales are one fp32 division
    bad = mism > 2e-3 or srel > 1e-5 or drel > 1e-2 or smis > 2e-3 or dt.isnan().any().item()
    name = f"G={g} {variant}"
    return f"{name:44s} {dname:5s} {mism:9.2e} {srel:9.2e} {drel:10.2e} {smis:7.1e}{'  FAIL' if bad else ''}", bad


def check_kernels(device: torch.device, group_sizes: tuple | None = None, tuning: Tuning = Tuning(),
                  jobs: int | None = None) -> bool:
    """The kernels against the reference on this device, one case of `CHECK_CASES` per code path
    (those of ``group_sizes`` only, if given; `check_case`), the sum once per distinct sum kernel.

    Compiling the kernels is most of the time and runs on the CPU: the cases run in ``jobs``
    worker processes (default: half the cores, at most 8) sharing the device; 1 runs them here."""
    cases = [i for i, (g, _, _) in enumerate(CHECK_CASES) if group_sizes is None or g in group_sizes]
    summed, with_sum = set(), {}  # (G, format, scales): the sum kernel reads only these
    for i in cases:
        g, variant, _ = CHECK_CASES[i]
        ref = TacoConfig(group_size=g, **VARIANTS[variant])
        with_sum[i] = (g, ref.format, ref.scales) not in summed
        summed.add((g, ref.format, ref.scales))
    jobs = min(8, max(1, (os.cpu_count() or 2) // 2)) if jobs is None else jobs
    print(f"check: triton vs torch reference on {device} ({len(cases)} cases, {min(jobs, len(cases))} processes)")
    print(f"{'config':44s} {'dtype':5s} {'payload!=':>9s} {'scale rel':>9s} {'decode rel':>10s} {'sum!=':>7s}")
    args = [(i, str(device), tuning, with_sum[i]) for i in cases]
    if jobs <= 1:
        results = [check_case(*a) for a in args]
    else:
        # spawn: a forked child cannot use the parent's CUDA context
        with ProcessPoolExecutor(min(jobs, len(cases)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(check_case, *zip(*args)))
    for line, _ in results:
        print(line)
    return not any(bad for _, bad in results)


def sweep_variants(base: Tuning = Tuning()) -> list[tuple[str, str, Tuning]]:
    """(name, input dtype, tuning) of every launch variant `sweep` can time, each a change of ``base``."""
    tiles = dict(rows_max_group=0)  # the tensor-core kernels at G = 128, which Gluon codes by default

    def each_step(**changes) -> dict:  # a change of every tensor-core step's `Launch`
        return {step: dataclasses.replace(base.launch(step), **changes) for step in STEPS}

    def tile_variant(*, stages=None, **changes) -> Tuning:  # the tensor-core kernels' launch settings
        if stages is not None:
            changes.update({step: dataclasses.replace(base.launch(step), num_stages=stages)
                            for step in ("compress", "decompress")})
        return base.replace(**tiles, **changes)

    variants = [("defaults", "bf16", base)]
    variants += [(f"{n} stages", "bf16", tile_variant(stages=n)) for n in (2, 4)]
    variants += [("all resident", "bf16", tile_variant(**each_step(programs_per_sm=None))),
                 ("one per tile", "bf16", tile_variant(**each_step(programs_per_sm=0)))]
    variants += [(f"{n} per SM", "bf16", tile_variant(**each_step(programs_per_sm=n))) for n in (2, 3, 4)]
    variants += [(f"{n} warps", "bf16", tile_variant(**each_step(num_warps=n))) for n in (4, 8)]
    variants += [("a group a lane", "bf16", base.replace(split_max_groups=0)),  # G = 128 split over lanes by default
                 ("tensor-core kernels", "bf16", base.replace(**tiles)),
                 ("bf16 decode", "bf16", tile_variant(payload_dot=False)),
                 ("16K per tile", "bf16", tile_variant(block_elems=16384)),
                 ("balanced grid", "bf16", tile_variant(balance=True)),
                 ("evict-first st", "bf16", tile_variant(stores=Store.STREAM)),
                 ("evict-first 3/SM", "bf16", base.replace(**tiles, stores=Store.STREAM,
                                                           decompress=dataclasses.replace(base.decompress,
                                                                                          programs_per_sm=3)))]
    variants += [(f"fp32 {name}", "fp32", tile_variant(dot_mode=mode)) for name, mode in (("tf32", DotMode.TF32),
                                                                                          ("bf16x2", DotMode.BF16X2))]
    return variants


def sweep(device: torch.device, numel: int, copy_bw: float, names: set[str] | None = None,
          base: Tuning = Tuning()) -> None:
    """Time launch variants at one size, G=128, against ``base`` (`sweep_variants`: pipeline
    stages, resident programs per SM, all that fit, or one program per tile instead of a
    persistent grid, each group of the Gluon encoder in one lane at every size, the tensor-core
    kernels instead of the Gluon ones (G <= 128 compresses and decompresses with the Gluon
    kernels on NVIDIA GPUs, so the variants of launch settings run the tensor-core kernels),
    decoding with bf16 instead of fp8 products, twice the values per tile, 4 or 8 warps in every
    kernel, a grid balanced to equal tile counts, evict-first stores of decoded values, and on
    fp32 input tf32 against two bf16 products); ``names``: only these. Each variant is a `Tuning`
    passed to the calls: nothing global changes."""
    cfg = TacoConfig(backend="triton")
    variants = [v for v in sweep_variants(base) if names is None or v[0] in names]
    print(f"\nsweep at {numel / 2**20:.0f}M elements, G=128 (fraction of copy bandwidth); defaults: {base}")
    print(f"{'variant':>18s} {'compress':>9s} {'decomp':>7s} {'sum P=2':>8s} {'sum P=8':>8s}")
    for name, dname, tuning in variants:
        try:
            rows = bench_case(numel, cfg, DTYPES[dname], device, (2, 8), backends=("triton",), eager=False,
                              tuning=tuning)
        except Exception as e:  # a variant that does not compile is a result too
            print(f"{name:>18s}  failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        frac = {r["step"]: r["bytes"] / r["seconds"] / copy_bw for r in rows}
        print(f"{name:>18s} {frac['compress']:9.2f} {frac['decompress']:7.2f} {frac['sum P=2']:8.2f} "
              f"{frac['sum P=8']:8.2f}", flush=True)


def parse_tuning(assignments: Sequence[str], base: Tuning = Tuning()) -> Tuning:
    """``base`` with ``KEY=JSON`` changes (a step's `Launch` merged field by field:
    ``stores=1``, ``compress={"num_warps": 8}``, ``rows_max_group=0``)."""
    fields = {f.name for f in dataclasses.fields(Tuning)}
    changes = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--tuning {item!r}: use KEY=JSON with KEY one of {sorted(fields)}")
        value = json.loads(text)
        current = getattr(base, key)
        changes[key] = dataclasses.replace(current, **value) if isinstance(current, Launch) else value
    return base.replace(**changes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="elements, e.g. 1M,16M,256M")
    parser.add_argument("--group-sizes", default="64,128,256")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--peers", default="2,4,8", help="P values for dequant-sum-requant")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--check", action="store_true", help="run the triton-vs-reference check only (CUDA)")
    parser.add_argument("--no-check", action="store_true", help="skip the triton-vs-reference check")
    parser.add_argument("--check-group-sizes", default=None, help="only these group sizes of the check's cases")
    parser.add_argument("--check-jobs", type=int, default=None,
                        help="processes compiling the check's cases (default: half the cores, at most 8; 1: this one)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the kernel variant sweep")
    parser.add_argument("--sweep-sizes", default="16M,64M", help="sizes of the kernel variant sweep")
    parser.add_argument("--sweep-variants", help="comma-separated names of the sweep's variants (default: all)")
    parser.add_argument("--tuning", nargs="+", default=[], metavar="KEY=JSON",
                        help="launch settings (fields of codec.Tuning) for the check, the sweep's base and the table")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = args.sizes or ("1M,4M,16M,64M,256M" if cuda else "64K,1M")
    sizes = [parse_size(s) for s in sizes.split(",")]
    peers = tuple(int(p) for p in args.peers.split(","))
    tuning = parse_tuning(args.tuning)
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        if args.tuning:
            print("tuning:", tuning)
        checked = tuple(int(g) for g in args.check_group_sizes.split(",")) if args.check_group_sizes else None
        if not args.no_check and not check_kernels(device, checked, tuning, args.check_jobs):
            raise SystemExit("kernel check failed")
        if args.check:
            return
    elif args.check:
        raise SystemExit("--check compares the Triton kernels with the reference on a CUDA device; this machine has none")
    copy_bw = copy_bandwidth(device)
    print(f"\ncopy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    same_size = {}  # a copy of each size's input, timed like the kernels: what launch and tail leave
    if cuda:
        for name, src, dst in (("compress", torch.bfloat16, torch.float8_e4m3fn),
                               ("decompress", torch.float8_e4m3fn, torch.bfloat16)):
            cast = cast_bandwidth(device, src, dst)
            print(f"Triton cast {str(src)[6:]} -> {str(dst)[6:]} ({name}'s traffic, no arithmetic): "
                  f"{cast / 1e9:.0f} GB/s = {cast / copy_bw:.2f} of copy")
        for numel in sizes:
            same_size[numel] = copy_bandwidth(device, numel, DTYPES[args.dtype], graph=True)
            print(f"{args.dtype} copy of {numel / 2**20:.2f}M values, graph-timed: {same_size[numel] / copy_bw:.2f} of copy")
    if cuda and not args.no_sweep:
        names = set(args.sweep_variants.split(",")) if args.sweep_variants else None
        for size in args.sweep_sizes.split(","):
            sweep(device, parse_size(size), copy_bw, names, tuning)
    print(f"\n{args.dtype} input; us = median device time (CUDA graph replays); GB/s = (bytes read +"
          f" written) / that time; frac = of copy bandwidth; of same = of the same-size copy; eager us = plain"
          f" launches, host overhead included")
    print(f"{'elements':>9s} {'G':>4s} {'step':>10s} {'backend':>7s} {'us':>9s} {'GB/s':>7s} {'frac':>5s} {'of same':>7s}"
          f" {'eager us':>9s}" + ("  speedup" if cuda else ""), flush=True)
    for numel, g in itertools.product(sizes, [int(v) for v in args.group_sizes.split(",")]):
        rows = bench_case(numel, TacoConfig(group_size=g), DTYPES[args.dtype], device, peers, tuning=tuning)
        for row in rows:  # printed per case, so a run cut short keeps what it measured
            speed = ""
            if cuda and row["backend"] == "triton":
                other = next(r for r in rows if r["step"] == row["step"] and r["backend"] == "torch")
                speed = f"  {other['seconds'] / row['seconds']:6.1f}x"
            gbs = row["bytes"] / row["seconds"] / 1e9
            same = f"{gbs * 1e9 / same_size[numel]:7.2f}" if numel in same_size else f"{'-':>7s}"
            print(f"{numel / 2**20:8.2f}M {g:4d} {row['step']:>10s} {row['backend']:>7s} "
                  f"{row['seconds'] * 1e6:9.1f} {gbs:7.0f} {gbs * 1e9 / copy_bw:5.2f} {same} {row['eager'] * 1e6:9.1f}{speed}",
                  flush=True)


if __name__ == "__main__":
    main()
