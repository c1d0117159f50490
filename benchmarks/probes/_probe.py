"""What the kernel probes share: loading kernel source as a module, checking variants of compress
and decompress against the committed kernels, and timing them alternately.

A variant is a callable with the committed kernels' `_into` signature minus the config:
``compress(x, buffer, layout)`` and ``decompress(buffer, layout, out)``; the dicts passed here
hold the committed kernels under "base".
"""
import importlib.util
import os
import statistics
import sys
import tempfile

import torch
import triton

from taco_accel.bench.codec import Rotating, copy_bandwidth, timer
from taco_accel.codec import TacoConfig, WireLayout, compress


def load_module(name: str, source: str):
    """Import ``source`` as module ``name`` from a file (triton reads a kernel's source from its file)."""
    path = os.path.join(tempfile.mkdtemp(), name.rpartition(".")[2] + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Timings:
    """Fractions of ``copy_bw`` for named callables, timed in turn for ``rounds`` rounds (median)."""

    def __init__(self, device: torch.device, copy_bw: float, rounds: int):
        self.device, self.copy_bw, self.rounds, self.rows = device, copy_bw, rounds, []

    def time(self, label: str, n: int, fns: dict, nbytes: int) -> None:
        res = {k: [] for k in fns}
        for _ in range(self.rounds):
            for k, fn in fns.items():
                res[k].append(nbytes / timer(fn, self.device) / self.copy_bw)
        med = {k: statistics.median(v) for k, v in res.items()}
        spread = max(max(v) - min(v) for v in res.values())
        self.rows.append((n, label, med))
        print(f"{n:4d}M {label:>17s}: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f"  (spread {spread:.3f})", flush=True)

    def table(self, names: list[str]) -> None:
        print(f"\nfraction of the 1 GiB copy, median of {self.rounds} alternating rounds")
        print(f"{'M':>5} {'step':>18}  " + "  ".join(f"{k:>11}" for k in names))
        for n, label, med in self.rows:
            print(f"{n:5d} {label:>18}  " + "  ".join(f"{med[k]:11.3f}" if k in med else f"{'':>11}" for k in names))


def gpu_timings(rounds: int) -> Timings:
    """`Timings` on the GPU against the 1 GiB copy, after a line naming the GPU, the versions and the copy."""
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    return Timings(dev, copy_bw, rounds)


def codec_table(timings: Timings, cfg: TacoConfig, comp: dict, dec: dict, sizes=(16, 64, 256)) -> None:
    """`codec_rows` at each size (M values), then the table of every variant."""
    for n in sizes:
        codec_rows(timings, n, n * 2**20, cfg, comp, dec)
        torch.cuda.empty_cache()
    timings.table(list(dict.fromkeys(list(comp) + list(dec))))


_grid = {}


def persistent(kern, tiles, nw, args, kwargs):
    """Launch ``kern`` with as many programs as fit on the GPU at once (registers, shared memory)."""
    key = (kern, nw, tuple(sorted(kwargs.items())))
    if key not in _grid:
        compiled = kern[(1,)](*args, **kwargs, num_warps=nw)
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        regs = -(-compiled.n_regs * 32 // 256) * 256 * nw
        per_sm = min(65536 // regs, props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024),
                     2048 // (32 * nw), 32)
        _grid[key] = per_sm * props.multi_processor_count
        print(f"{kern.fn.__name__} w{nw} {kwargs.get('STAGES')} stages: {compiled.n_regs} registers, "
              f"{compiled.metadata.shared} B shared, {per_sm} programs per SM", flush=True)
    kern[(min(tiles, _grid[key]),)](*args, **kwargs, num_warps=nw)


def encoder_reference_check(cfg: TacoConfig, comp: dict, sizes=(128 * 1000 + 128 * 4, 128 * 12345 + 64)) -> None:
    """Each compress variant against the reference codec on bf16 values with NaN, +-Inf, 3e38,
    1e-35 and zero groups (``sizes``: values; the defaults end inside a group and a tile, a
    variant that needs whole groups gets sizes that are multiples of G): payload bytes must
    equal the reference's or those of "base" (the library's encoder, listed first); differing
    scale and padding bytes are printed."""
    dev, g = torch.device("cuda"), cfg.group_size
    ref_cfg = cfg.replace(backend="torch")
    torch.manual_seed(0)
    for numel in sizes:
        x = torch.randn(numel, device=dev) * torch.logspace(-6, 6, numel, device=dev)
        x[g * 7 + 3] = float("nan")
        x[g * 9 + 5] = float("inf")
        x[g * 40 + 1] = -float("inf")
        x[g * 41: g * 42] = 3e38
        x[g * 11: g * 12] = 1e-35
        x[g * 13: g * 14] = 0.0
        x = x.to(torch.bfloat16)
        lay = WireLayout.for_tensor(numel, cfg)
        ref = compress(x, ref_cfg).buffer
        payload = lay.groups_per_chunk * g
        bufs = {}
        for name, fn in comp.items():
            buf = bufs[name] = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device=dev)
            fn(x, buf, lay)
            diff = (buf != ref).nonzero().flatten()
            pay = diff[diff < payload]
            print(f"ref check {numel} compress {name}: {len(diff)} bytes differ from the reference: payload groups "
                  f"{(pay // g).unique().tolist()[:12]}, scale / padding bytes {diff[diff >= payload].tolist()[:12]}",
                  flush=True)
            # a tie may round either way: equal to the reference's payload or to the library's
            assert len(pay) == 0 or torch.equal(buf[:payload], bufs["base"][:payload]), name


def compress_sizes(timings: Timings, cfg: TacoConfig, comp: dict, sizes, base: str,
                   outputs_in_turn: bool = False, chunks: int = 1, table: bool = True) -> None:
    """At each size (M bf16 values, rotated inputs) every compress variant of ``comp`` writes what
    ``base`` (listed first) writes into a poisoned buffer; then they are timed in turn, into that
    buffer and, with ``outputs_in_turn``, into 8 outputs in turn too (which the L2 cache does not
    keep between calls). ``chunks`` > 1: the two-shot all-reduce's layout (`compress(x,
    chunks=P)`), rows labelled "P=..". Then the table (``table``)."""
    dev = timings.device
    for n in sizes:
        numel = n * 2**20
        lay = WireLayout.for_tensor(numel, cfg, chunks)
        xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16), numel * 2, dev)
        bufs = {k: torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device=dev) for k in comp}
        for k, fn in comp.items():
            fn(xs.items[0], bufs[k], lay)
            assert torch.equal(bufs[k], bufs[base]), k
        nbytes = numel * 2 + lay.total_bytes
        label = f"P={chunks}" if chunks > 1 else "one output" if outputs_in_turn else "compress"
        timings.time(label, n,
                     {k: (lambda fn=fn, k=k: fn(xs.next(), bufs[k], lay)) for k, fn in comp.items()}, nbytes)
        if outputs_in_turn:
            outs = Rotating(lambda: torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev), lay.total_bytes, dev)
            timings.time(f"P={chunks}, 8 outs" if chunks > 1 else "8 outputs", n,
                         {k: (lambda fn=fn: fn(xs.next(), outs.next(), lay)) for k, fn in comp.items()}, nbytes)
            del outs
        del xs, bufs
        torch.cuda.empty_cache()
    if table:
        timings.table(list(comp))


def with_setting(table: dict, key, value, fn):
    """``fn`` with ``table[key] = value`` for the length of each call (a launch setting of the
    library's, such as `triton_kernels.TUNING` or `gluon_kernels.MAX_REGISTERS`)."""
    def call(*args):
        saved = table[key]
        table[key] = value
        try:
            fn(*args)
        finally:
            table[key] = saved
    return call


def library_encoder(cfg: TacoConfig, schedule: dict | None = None, **tuning):
    """`triton_kernels.compress_into` as a variant, with `triton_kernels.TUNING`[key] = value for
    each of ``tuning`` (rows_max_group=0: the tensor-core encoder; split_max_groups=0: a group a
    lane) and `gluon_kernels`' SPLIT_<key> = value for each of ``schedule`` (HEAD_WAVES: 0.125,
    say) set for each call."""
    from taco_accel.codec import gluon_kernels as gk
    from taco_accel.codec import triton_kernels as tk

    def run(x, buf, lay):
        tk.compress_into(x, buf, lay, cfg)
    for key, value in (schedule or {}).items():
        run = with_setting(vars(gk), f"SPLIT_{key}", value, run)
    for key, value in tuning.items():
        run = with_setting(tk.TUNING, key, value, run)
    return run


def library_decoder(cfg: TacoConfig, rows_max_group: int | None = None):
    """`triton_kernels.decompress_into` as a variant; ``rows_max_group`` set for the call (0: the
    tensor-core decoder at every G; None: the library's choice)."""
    from taco_accel.codec import triton_kernels as tk

    def run(buf, lay, out):
        tk.decompress_into(buf, lay, cfg, out)
    return run if rows_max_group is None else with_setting(tk.TUNING, "rows_max_group", rows_max_group, run)


def decoder_rows(timings: Timings, label: str, n: int, cfg: TacoConfig, dec: dict, check=None) -> None:
    """Decode rotated payloads of ``n`` M bf16 values with each of ``dec`` once (``check`` gets the
    outputs by name), then time them into one output each and into 8 outputs in turn."""
    dev, numel = timings.device, n * 2**20
    lay = WireLayout.for_tensor(numel, cfg)
    packs = Rotating(lambda: compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), cfg).buffer,
                     lay.total_bytes, dev)
    outs = {k: torch.empty(numel, dtype=torch.bfloat16, device=dev) for k in dec}
    for k, fn in dec.items():
        fn(packs.items[0], lay, outs[k])
    if check is not None:
        check(outs)
    nbytes = numel * 2 + lay.total_bytes
    timings.time(f"{label}decompress", n, {k: (lambda fn=fn, k=k: fn(packs.next(), lay, outs[k]))
                                           for k, fn in dec.items()}, nbytes)
    outs8 = Rotating(lambda: torch.empty(numel, dtype=torch.bfloat16, device=dev), numel * 2, dev)
    timings.time(f"{label}8 outputs", n, {k: (lambda fn=fn: fn(packs.next(), lay, outs8.next()))
                                          for k, fn in dec.items()}, nbytes)


def codec_rows(timings: Timings, n: int, numel: int, cfg: TacoConfig, comp: dict, dec: dict) -> tuple:
    """Check every compress / decompress variant against "base" on poisoned outputs, then time them
    (and decompress into 8 outputs in turn at 16M, where one output stays in the L2 cache).
    Returns the bf16 inputs and packed buffers, for rows of the caller's own."""
    dev = timings.device
    lay = WireLayout.for_tensor(numel, cfg)
    wire = lay.total_bytes
    xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16) * 0.02, numel * 2, dev)
    packs = Rotating(lambda: compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), cfg).buffer, wire, dev)
    bufs = {k: torch.full((wire,), 0xAB, dtype=torch.uint8, device=dev) for k in comp}
    outs = {k: torch.full((numel,), float("nan"), dtype=torch.bfloat16, device=dev) for k in dec}
    for k, fn in comp.items():
        fn(xs.items[0], bufs[k], lay)
    for k, fn in dec.items():
        fn(packs.items[0], lay, outs[k])
    ref = outs["base"].float()
    for k in comp:
        differ = (bufs[k] != bufs["base"]).float().mean().item()
        print(f"{n:4d}M check compress {k}: bytes differing from base {differ:.2e}", flush=True)
        assert differ < 1e-3, k
    for k in dec:
        err = ((outs[k].float() - ref).abs().max() / ref.abs().max()).item()
        print(f"{n:4d}M check decompress {k}: max |diff| / max {err:.2e}, all written "
              f"{bool(torch.isfinite(outs[k]).all())}", flush=True)
        assert err < 1e-2 and torch.isfinite(outs[k]).all(), k
    nbytes = numel * 2 + wire
    timings.time("compress", n, {k: (lambda fn=fn, k=k: fn(xs.next(), bufs[k], lay)) for k, fn in comp.items()}, nbytes)
    timings.time("decompress", n, {k: (lambda fn=fn, k=k: fn(packs.next(), lay, outs[k])) for k, fn in dec.items()},
                 nbytes)
    if n == 16:
        outs8 = Rotating(lambda: torch.empty(numel, dtype=torch.bfloat16, device=dev), numel * 2, dev)
        timings.time("decompress 8 outs", n, {k: (lambda fn=fn: fn(packs.next(), lay, outs8.next()))
                                              for k, fn in dec.items()}, nbytes)
    return xs, packs
