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
import importlib.util
import os
import statistics
import sys
import tempfile

import torch
from taco_accel.codec import TacoConfig, WireLayout, compress
from taco_accel.bench.codec import timer, copy_bandwidth, Rotating

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
tmp = tempfile.mkdtemp()
mods = {}
for name, (subs, tuning) in VARIANTS.items():
    src = SRC
    for a, b in subs:
        src = src.replace(a, b)
    path = os.path.join(tmp, f"var_{name}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"taco_accel.codec.var_{name}", path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
    for k, v in tuning.items():
        m.TUNING[k] = {**m.TUNING[k], **v} if isinstance(v, dict) else v
    mods[name] = m

CPU_SMOKE = not torch.cuda.is_available()  # TRITON_INTERPRET=1: the script's own logic, tiny sizes
dev = torch.device("cpu" if CPU_SMOKE else "cuda")
M = 2**8 if CPU_SMOKE else 2**20
SIZES = (16,) if CPU_SMOKE else (16, 64, 256)
copy_bw = copy_bandwidth(dev)
print(f"{dev} torch {torch.__version__} copy {copy_bw/1e9:.0f} GB/s", flush=True)
cfg = TacoConfig(backend="triton")
ROUNDS = 1 if CPU_SMOKE else 3
rows = []


def sync():
    if not CPU_SMOKE:
        torch.cuda.synchronize(); torch.cuda.empty_cache()


def time_variants(label, n, names, make_fn, nbytes):
    res = {k: [] for k in names}
    for _ in range(ROUNDS):
        for k in names:
            res[k].append(nbytes / timer(make_fn(k), dev) / copy_bw)
    med = {k: statistics.median(v) for k, v in res.items()}
    spread = max(max(v) - min(v) for v in res.values())
    rows.append((n, label, med, spread))
    print(f"{n:4d}M {label:>16s}: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()) + f"  (spread {spread:.3f})", flush=True)


for n in SIZES:
    numel = n * M
    lay = WireLayout.for_tensor(numel, cfg)
    wire = lay.total_bytes
    xs = Rotating(lambda: torch.randn(numel, device=dev, dtype=torch.bfloat16) * 0.02, numel * 2, dev)
    packs = Rotating(lambda: compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), cfg).buffer, wire, dev)
    outs8 = Rotating(lambda: torch.empty(numel, dtype=torch.bfloat16, device=dev), numel * 2, dev)
    bufs = {k: torch.empty(wire, dtype=torch.uint8, device=dev) for k in mods}
    outs = {k: torch.empty(numel, dtype=torch.bfloat16, device=dev) for k in mods}
    # correctness against base on the first inputs
    for k, m in mods.items():
        bufs[k].fill_(0xAB); outs[k].fill_(float("nan"))
        m.compress_into(xs.items[0], bufs[k], lay, cfg)
        m.decompress_into(packs.items[0], lay, cfg, outs[k])
    sync()
    for k in mods:
        diff = (bufs[k] != bufs["base"]).float().mean().item()
        d = (outs[k].float() - outs["base"].float()).abs().max().item()
        ref = outs["base"].float().abs().max().item()
        print(f"{n:4d}M check {k}: compress bytes differing {diff:.2e}, decompress max |diff| / max {d / ref:.2e}, "
              f"finite {bool(torch.isfinite(outs[k]).all())}", flush=True)
        assert diff < 1e-3 and d / ref < 1e-2 and torch.isfinite(outs[k]).all()
    nb = numel * 2 + wire
    time_variants("compress", n, list(mods), lambda k: (lambda: mods[k].compress_into(xs.next(), bufs[k], lay, cfg)), nb)
    time_variants("decompress", n, list(mods), lambda k: (lambda: mods[k].decompress_into(packs.next(), lay, cfg, outs[k])), nb)
    if n == 16:  # larger outputs do not fit the L2 cache anyway
        time_variants("decompress 8 outs", n, list(mods),
                      lambda k: (lambda: mods[k].decompress_into(packs.next(), lay, cfg, outs8.next())), nb)
    for p in (2, 4) if n <= 64 else ():
        st = Rotating(lambda: torch.stack([compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), cfg).buffer
                                           for _ in range(p)]), wire * p, dev)
        for k in ("base", "blocked"):
            mods[k].sum_into(st.items[0], lay, cfg, bufs[k])
        sync()
        same = torch.equal(bufs["base"], bufs["blocked"])
        print(f"{n:4d}M sum P={p} blocked equal to base: {same}", flush=True)
        assert same
        time_variants(f"sum P={p}", n, ["base", "blocked"],
                      lambda k: (lambda: mods[k].sum_into(st.next(), lay, cfg, bufs[k])), (p + 1) * wire)
        del st
    if n <= 64:  # where the transform's time goes
        plain = cfg.replace(hadamard=False)
        lay_p = WireLayout.for_tensor(numel, plain)
        packs_p = Rotating(lambda: compress(torch.randn(numel, device=dev, dtype=torch.bfloat16), plain).buffer,
                           lay_p.total_bytes, dev)
        m = mods["base"]
        cases = {"base": (cfg, lay, packs), "no-hadamard": (plain, lay_p, packs_p)}
        time_variants("compress H?", n, list(cases),
                      lambda k: (lambda: m.compress_into(xs.next(), bufs["base"], cases[k][1], cases[k][0])), nb)
        time_variants("decompress H?", n, list(cases),
                      lambda k: (lambda: m.decompress_into(cases[k][2].next(), cases[k][1], cases[k][0], outs["base"])), nb)
        del packs_p
    del xs, packs, outs8, bufs, outs
    sync()

for name, m in mods.items():
    print(name, "resident (programs per SM, stages):", {k[0]: v for k, v in m._resident.items()})
print("\nfraction of the 1 GiB copy, median of", ROUNDS, "alternating rounds")
print(f"{'M':>5} {'step':>18}  " + "  ".join(f"{k:>11}" for k in ("base", "blocked", "bg32", "cs", "no-hadamard")) + "  spread")
for n, label, med, spread in rows:
    cells = "  ".join(f"{med[k]:11.3f}" if k in med else f"{'':>11}" for k in ("base", "blocked", "bg32", "cs", "no-hadamard"))
    print(f"{n:5d} {label:>18}  {cells}  {spread:.3f}")
