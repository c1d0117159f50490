"""Run 10: what the one-group-per-thread kernels compile to on sm_90, without a GPU.

    PYTHONPATH=. python benchmarks/probes/run10_sass.py

For each G = 128 decoder and encoder (bf16 values, e4m3 payload, default flags): registers,
shared memory, SASS instructions per thread and the memory and shared-memory instructions among
them. "gluon": the Gluon probes (`gluon_rows.py`) and the library decoder (`gluon_kernels.py`);
"block language": the same arithmetic in Triton's block language (`tl_rows.py`), where the
compiler places values on lanes itself. The counts depend on the triton version (the H200 runs
3.6; RESULTS.md, tenth run, has both).
"""
import os
import re
import subprocess
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

import gluon_rows as gr
import tl_rows as tr
from taco_accel.codec import gluon_kernels as gk

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def stats(name, source_cls, fn, signature, constexprs, warps):
    signature = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v != "constexpr" and k not in ("chunks", "tiles_per_chunk")}
    try:
        kernel = triton.compile(source_cls(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
    except Exception as e:  # Gluon's API moves between versions (async copies: triton 3.6 here, not 3.9)
        print(f"{name:34s} does not compile: {str(e.__cause__ or e).splitlines()[-1][:80]}")
        return
    path = f"/tmp/run10_{name.replace(' ', '_')}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "--dump-sass", path], capture_output=True, text=True).stdout
    usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    ops = Counter(m.group(1) for m in map(INSTRUCTION.match, sass.splitlines()) if m)
    regs = re.search(r"REG:(\d+)", usage).group(1)
    mem = {k: sum(v for op, v in ops.items() if op.startswith(k)) for k in ("LDG", "STG", "LDS", "STS", "SHFL", "BAR")}
    print(f"{name:34s} {regs:>4s} {kernel.metadata.shared:7d} {sum(ops.values()):6d} "
          + " ".join(f"{mem[k]:4d}" for k in mem), flush=True)


ptrs = dict(q_ptr="*fp8e4nv", s_ptr="*fp32")
print(f"triton {triton.__version__}, sm_90, G = 128, bf16 / e4m3")
print(f"{'kernel':34s} {'regs':>4s} {'shared':>7s} {'instr':>6s}  LDG  STG  LDS  STS SHFL  BAR")
for w in (1, 4):
    stats(f"gluon decode, {w} warp(s)", GluonASTSource, gr.decompress_rows,
          dict(ptrs, out_ptr="*bf16", numel="i32", gpc="i32"), dict(G=128, NW=w, OUT_BYTES=2), w)
    stats(f"gluon encode, {w} warp(s)", GluonASTSource, gr.compress_rows,
          dict(x_ptr="*bf16", **ptrs, numel="i32", gpc="i32", chunk_bytes="i32"),
          dict(G=128, NW=w, QMAX=448.0, TINY=1e-33, X_BYTES=2, PAD=8), w)
stats("gluon encode, ring of 2, 1 warp", GluonASTSource, gr.compress_rows_ring,
      dict(x_ptr="*bf16", **ptrs, numel="i32", gpc="i32", chunk_bytes="i32"),
      dict(G=128, NW=1, QMAX=448.0, TINY=1e-33, X_BYTES=2, PAD=8, STAGES=2), 1)
stats("library gluon decoder", GluonASTSource, gk._decompress_rows_kernel,
      dict(ptrs, out_ptr="*bf16", sign_ptr="*fp32", numel="i32", gpc="i32", chunk_bytes="i32"),
      dict(G=128, NW=gk.WARPS, Q_BYTES=1, OUT_BYTES=2, HADAMARD=True, SIGNS=False, DUAL=False, CHUNKED=False,
           WIDE=False), gk.WARPS)
ints = dict(numel="i32", chunks="i32", gpc="i32", chunk_bytes="i32", tiles_per_chunk="i32")
for w in (1, 2):
    stats(f"block language decode, {w} warp(s)", ASTSource, tr.decompress_rows_kernel,
          dict(ptrs, out_ptr="*bf16", sign_ptr="*fp32", **ints),
          dict(G=128, BG=32 * w, HADAMARD=True, SIGNS=False, DUAL=False, NUM_STAGES=1), w)
    stats(f"block language encode, {w} warp(s)", ASTSource, tr.compress_rows_kernel,
          dict(x_ptr="*bf16", **ptrs, sign_ptr="*fp32", **ints),
          dict(G=128, BG=32 * w, FMT=0, QMAX=448.0, HADAMARD=True, SIGNS=False, DUAL=False, ADAPTIVE=True,
               ZERO_NONFINITE=False, EMULATE_ROUND=False, PAD=0, NUM_STAGES=1), w)
