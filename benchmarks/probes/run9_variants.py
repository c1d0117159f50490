"""Run 9: kernel variants built from the committed triton_kernels.py by source substitution, each
loaded as a module of its own, timed alternately against the committed code (also loaded as a
copy) on rotated inputs, CUDA-graph timed, 3 rounds, median; every variant checked against base.

  base     the committed kernels
  blocked  each persistent program walks one contiguous run of tiles (not every num_programs-th)
  bg32     tiles of 32 groups (mma.sync instead of the warpgroup product), 4 warps, as many
           programs per SM as fit (decompress: 88 registers, 10.5 KiB shared memory on sm_90)
  cs       base with evict-first (.cs) stores in decompress; its compress is base's code loaded
           twice (the noise floor)
Also: base with hadamard=False (where the transform's time goes at 16M), and decompress into 8
rotating output buffers instead of one (how much of the 16M figure is the L2 cache).

    PYTHONPATH=. python benchmarks/probes/run9_variants.py                     # H200, from the repository root
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/probes/run9_variants.py  # CPU: the script's logic only

Result: benchmarks/RESULTS.md, ninth run (no variant kept).
"""
import torch

from _probe import Timings, codec_rows, load_module
from taco_accel.bench.codec import Rotating, copy_bandwidth
from taco_accel.codec import TacoConfig, WireLayout, compress

SRC = open("taco_accel/codec/triton_kernels.py").read()
LOOP = "    for tile in tl.range(tl.program_id(0), tiles_per_chunk * chunks, tl.num_programs(0), num_stages=NUM_STAGES):\n"
BLOCKED = ("    total = tiles_per_chunk * chunks\n    per = tl.cdiv(total, tl.num_programs(0))\n"
           "    first = tl.program_id(0) * per\n"
           "    for tile in tl.range(first, tl.minimum(first + per, total), 1, num_stages=NUM_STAGES):\n")
assert SRC.count(LOOP) == 3
BG_FLOOR = "bg = max(64 if transform else 16,"
assert SRC.count(BG_FLOOR) == 1
VARIANTS = {
    "base": ([], {}),
    "blocked": ([(LOOP, BLOCKED)], {}),
    "bg32": ([(BG_FLOOR, "bg = max(32 if transform else 16,")],
             {"block_elems": 4096, "num_warps": {"compress": 4, "decompress": 4},
              "programs_per_sm": {"compress": None, "decompress": None}}),
    "cs": ([], {"stores": 1}),
}
mods = {}
for name, (subs, tuning) in VARIANTS.items():
    src = SRC
    for a, b in subs:
        src = src.replace(a, b)
    m = mods[name] = load_module(f"taco_accel.codec.var_{name}", src)  # a module of the package: relative imports
    for k, v in tuning.items():
        m.TUNING[k] = {**m.TUNING[k], **v} if isinstance(v, dict) else v

CPU_SMOKE = not torch.cuda.is_available()  # TRITON_INTERPRET=1: the script's own logic, tiny sizes
dev = torch.device("cpu" if CPU_SMOKE else "cuda")
M = 2**8 if CPU_SMOKE else 2**20
SIZES = (16,) if CPU_SMOKE else (16, 64, 256)
copy_bw = copy_bandwidth(dev)
print(f"{dev} torch {torch.__version__} copy {copy_bw/1e9:.0f} GB/s", flush=True)
cfg = TacoConfig(backend="triton")
timings = Timings(dev, copy_bw, rounds=1 if CPU_SMOKE else 3)


def run_sizes():
    for n in SIZES:
        numel = n * M
        lay = WireLayout.for_tensor(numel, cfg)
        comp = {k: (lambda x, buf, lay, m=m: m.compress_into(x, buf, lay, cfg)) for k, m in mods.items()}
        dec = {k: (lambda buf, lay, out, m=m: m.decompress_into(buf, lay, cfg, out)) for k, m in mods.items()}
        xs, packs = codec_rows(timings, n, numel, cfg, comp, dec)
        out = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
        for p in (2, 4) if n <= 64 else ():
            st = Rotating(lambda: torch.stack([compress(torch.randn(numel, device=dev, dtype=torch.bfloat16),
                                                        cfg).buffer for _ in range(p)]), lay.total_bytes * p, dev)
            sums = {}
            for k in ("base", "blocked"):
                mods[k].sum_into(st.items[0], lay, cfg, out)
                sums[k] = out.clone()
            same = torch.equal(sums["base"], sums["blocked"])
            print(f"{n:4d}M sum P={p} blocked equal to base: {same}", flush=True)
            assert same
            timings.time(f"sum P={p}", n, {k: (lambda m=mods[k]: m.sum_into(st.next(), lay, cfg, out))
                                           for k in ("base", "blocked")}, (p + 1) * lay.total_bytes)
        if n <= 64:  # where the transform's time goes
            plain = cfg.replace(hadamard=False)
            lay_p = WireLayout.for_tensor(numel, plain)
            packs_p = Rotating(lambda: compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), plain).buffer,
                               lay_p.total_bytes, dev)
            m, dec_out = mods["base"], torch.empty(numel, dtype=torch.bfloat16, device=dev)
            cases = {"base": (cfg, lay, packs), "no-hadamard": (plain, lay_p, packs_p)}
            timings.time("compress H?", n, {k: (lambda c=c: m.compress_into(xs.next(), out, c[1], c[0]))
                                            for k, c in cases.items()}, numel * 2 + lay.total_bytes)
            timings.time("decompress H?", n, {k: (lambda c=c: m.decompress_into(c[2].next(), c[1], c[0], dec_out))
                                              for k, c in cases.items()}, numel * 2 + lay.total_bytes)
        if not CPU_SMOKE:
            torch.cuda.empty_cache()


run_sizes()
timings.table(["base", "blocked", "bg32", "cs", "no-hadamard"])
