"""Run 12 probe: where compress loses its time at 16M values (bf16, G = 128).

1. Time against size (4M..64M, CUDA graphs, rotated inputs): the library's encoder, the probe's
   words encoder (`gluon_words.compress_words`, the same SASS) with and without the transform,
   without bounds masks, with evict-first input loads; the library's decoder and torch's copy.
   A line t = a + b * n through 16M..64M gives each its fixed cost a.
2. A timeline: each program of the words encoder stamps %globaltimer at its start, when its tile
   has crossed shared memory, when its scales are known and at its end, and its SM: how many
   programs load / compute / store over time, and how long the end waits after the last tile.

    cd benchmarks/probes && PYTHONPATH=../..:. python run12_tail.py [out_dir]   # H200 only (Gluon)
"""
import statistics
import sys

import torch
import triton

from _probe import gpu_timings
from gluon_words import words_launcher as words
from taco_accel.bench.codec import Rotating, timer
from taco_accel.codec import TacoConfig, WireLayout
from taco_accel.codec import triton_kernels as tk

cfg = TacoConfig(backend="triton")


def timeline(n, flags, label, out_dir=None, launcher=words, group_per_program=32):
    """Launch the words encoder with ``flags`` (or ``launcher(**flags)``, whose programs encode
    ``group_per_program`` groups each) 6 times back to back on rotated inputs of ``n`` M values;
    print the last launch's timeline (and save its stamps to ``out_dir``)."""
    dev = torch.device("cuda")
    numel = n * 2**20
    lay = WireLayout.for_tensor(numel, cfg)
    xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16), numel * 2, dev)
    buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
    programs = triton.cdiv(lay.groups_per_chunk, group_per_program)
    t = torch.zeros(programs, 5, dtype=torch.int64, device=dev)
    run = launcher(**flags)
    for _ in range(6):
        run(xs.next(), buf, lay, t)
    torch.cuda.synchronize()
    stamps = t.cpu()
    if out_dir:
        torch.save(stamps, f"{out_dir}/timeline_{label.replace(' ', '_')}_{n}M.pt")
    ts = (stamps[:, :4] - stamps[:, 0].min()).double() / 1e3  # us from the first start
    start, arrived, scaled, end = ts.unbind(1)
    span = end.max().item()
    sm = stamps[:, 4]
    last = torch.stack([end[sm == s].max() for s in sm.unique()])
    print(f"\n{label} {n}M: {programs} programs on {sm.unique().numel()} SMs, span {span:.2f} us; "
          f"median load {(arrived - start).median():.2f}, transform+scales {(scaled - arrived).median():.2f}, "
          f"quantise+store {(end - scaled).median():.2f} us; last start {start.max():.2f}, last tile in "
          f"{arrived.max():.2f}, 99% in {arrived.quantile(0.99):.2f}, 90% in {arrived.quantile(0.9):.2f}; "
          f"SMs' last ends {last.min():.2f} / {last.median():.2f} / {last.max():.2f} (min / median / max)")
    step = max(0.5, span / 24)
    print(f"{'us':>6} {'loading':>8} {'computing':>9} {'storing':>8} {'started':>8} {'ended':>6}")
    for i in range(int(span / step) + 1):
        a = i * step
        b = a + step
        mid = (a + b) / 2
        print(f"{a:6.2f} {int(((start <= mid) & (arrived > mid)).sum()):8d} {int(((arrived <= mid) & (scaled > mid)).sum()):9d} "
              f"{int(((scaled <= mid) & (end > mid)).sum()):8d} {int(((start >= a) & (start < b)).sum()):8d} "
              f"{int(((end >= a) & (end < b)).sum()):6d}")


def sweep():
    """Time against size, and the fixed cost of each variant."""
    COMP = {"library": lambda x, buf, lay: tk.compress_into(x, buf, lay, cfg),
            "words": words(),
            "no transform": words(HADAMARD=False),
            "unmasked": words(MASKED=False),
            "evict first": words(EVICT="evict_first")}

    timings = gpu_timings(rounds=3)
    dev, copy_bw = timings.device, timings.copy_bw
    sizes = (4, 8, 12, 16, 24, 32, 48, 64)
    seconds = {}
    for n in sizes:
        numel = n * 2**20
        lay = WireLayout.for_tensor(numel, cfg)
        xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16), numel * 2, dev)
        ref = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
        COMP["library"](xs.items[0], ref, lay)
        bufs = {k: torch.empty_like(ref) for k in COMP}
        for k, fn in COMP.items():
            fn(xs.items[0], bufs[k], lay)
            if k != "no transform":
                assert torch.equal(bufs[k], ref), k  # whole tiles at every size here: no padding, no masks needed
        packs = Rotating(lambda: ref.clone(), lay.total_bytes, dev)
        out = torch.empty(numel, dtype=torch.bfloat16, device=dev)
        fns = {k: (lambda fn=fn, k=k: fn(xs.next(), bufs[k], lay)) for k, fn in COMP.items()}
        fns["decoder"] = lambda: tk.decompress_into(packs.next(), lay, cfg, out)
        fns["copy"] = lambda: out.copy_(xs.next())
        for _ in range(timings.rounds):
            for k, fn in fns.items():
                seconds.setdefault((n, k), []).append(timer(fn, dev))
        nbytes = numel * 2 + lay.total_bytes
        row = {k: statistics.median(seconds[(n, k)]) for k in fns}
        print(f"{n:3d}M " + "  ".join(f"{k} {row[k] * 1e6:6.2f} us {(numel * 4 if k == 'copy' else nbytes) / row[k] / copy_bw:.3f}"
                                      for k in fns), flush=True)
        torch.cuda.empty_cache()

    print("\nfixed cost a (us) and bandwidth 1 / b (fraction of copy) of t = a + b * bytes, 16M..64M")
    for k in list(COMP) + ["decoder", "copy"]:
        xs_, ys = [], []
        for n in sizes:
            if n >= 16:
                numel = n * 2**20
                xs_.append(numel * 4 if k == "copy" else numel * 2 + WireLayout.for_tensor(numel, cfg).total_bytes)
                ys.append(statistics.median(seconds[(n, k)]))
        mx, my = statistics.mean(xs_), statistics.mean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs_, ys)) / sum((x - mx) ** 2 for x in xs_)
        print(f"{k:>14}: a = {(my - b * mx) * 1e6:5.2f} us, 1 / b = {1 / b / copy_bw:.3f} of copy")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("run12_tail.py needs a GPU: Gluon kernels do not run in the interpreter")
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    sweep()
    for n in (16, 64):
        timeline(n, {}, "transform", out_dir)
        timeline(n, dict(HADAMARD=False), "no transform", out_dir)
