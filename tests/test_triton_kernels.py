"""The fused Triton kernels against the PyTorch reference codec.

On a CPU machine they run under TRITON_INTERPRET=1 (conftest.py), whose arithmetic differs
from fp32 in places (it keeps wider intermediates and truncates bf16 casts), so payloads may
disagree by one fp8 step on a few values; on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")


def _interpreter_refused_by_numpy() -> str | None:
    """Why the Triton interpreter cannot run a kernel with a loop over a runtime bound here, or
    None. Triton 3.6's interpreter turns the bound into a one-element array and hands it to
    ``range``, which NumPy 2.4 refuses ("only 0-dimensional arrays ..."); every kernel here loops
    so, and would fail for that reason alone (the kernels are the GPU's; only this CPU test run
    uses the interpreter)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def count(out, n):
        total = 0
        for _ in range(n):
            total += 1
        tl.store(out, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 2)
    except Exception as error:  # noqa: BLE001 - the interpreter wraps it in its own error type
        if "0-dimensional" not in str(error):
            raise
        return (f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1, the CPU run of the kernels) fails "
                f"on NumPy {numpy.__version__}: pip install 'numpy<2.4' (scripts/stacks/oldest.txt), or a newer Triton")
    assert int(out) == 2, int(out)
    return None


if (_refused := _interpreter_refused_by_numpy()) is not None:
    pytest.skip(_refused, allow_module_level=True)

from taco_accel.bench.codec import CHECK_CASES, VARIANTS  # noqa: E402
from taco_accel.bench.codec import DTYPES as NAMED_DTYPES  # noqa: E402
from taco_accel.codec import (  # noqa: E402
    NonFiniteError, Packed, TacoConfig, Tuning, WireLayout, compress, decompress, dispatch, sum_packed,
)
from taco_accel.codec.dispatch import Kernel  # noqa: E402
from taco_accel.codec.kernels import sm_count  # noqa: E402
from taco_accel.codec.layout import signed_header  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Values next to a rounding tie (common with bf16 inputs and no Hadamard step) may land on
# either side, one fp8 step apart: the interpreter multiplies in wider precision, and on an
# H200 (triton 3.6) up to 0.2% of such payload values differed. Elsewhere they agree exactly.
MAX_MISMATCH = 5e-3


def configs(group_size: int, variant: str) -> tuple[TacoConfig, TacoConfig]:
    ref = TacoConfig(group_size=group_size, backend="torch", **VARIANTS[variant])
    return ref, ref.replace(backend="triton")


def as_triton(packed: Packed, config: TacoConfig) -> Packed:
    return Packed(packed.buffer, packed.shape, packed.dtype, config, packed.layout)


def sample(shape, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0])[:, None]
    return rows.to(dtype).to(DEVICE)


def assert_payload_close(ref: Packed, tri: Packed, fmt: str, max_mismatch: float = MAX_MISMATCH) -> None:
    """Payload bytes equal, up to a few values one grid step apart (rounding at a tie)."""
    lay = ref.layout
    qr = lay.payload(ref.buffer, fmt).float().cpu()
    qt = lay.payload(tri.buffer, fmt).float().cpu()
    differ = qr != qt
    assert differ.float().mean() <= max_mismatch, f"{differ.float().mean():.2e} of the payload differs"
    if differ.any():
        step = qr[differ].abs().clamp_min(2**-9) * (2**-2 if fmt == "e4m3" else 2**-1) if fmt != "int8" else 1.0
        assert ((qr[differ] - qt[differ]).abs() <= step + 1e-6).all()
    sr, st = lay.scales(ref.buffer).cpu(), lay.scales(tri.buffer).cpu()
    torch.testing.assert_close(st, sr, rtol=1e-5, atol=0, equal_nan=True)


# One case per code path (bench.codec.CHECK_CASES), not the grid of group sizes x variants x dtypes
MATCH_CASES = [(g, v, NAMED_DTYPES[d]) for g, v, d in CHECK_CASES]


@pytest.mark.parametrize("group_size, variant, dtype", MATCH_CASES,
                         ids=[f"G{g}-{v}-{str(d).removeprefix('torch.')}" for g, v, d in MATCH_CASES])
def test_compress_decompress_match_reference(group_size, variant, dtype):
    ref_cfg, tri_cfg = configs(group_size, variant)
    x = sample((6, 1000 + group_size // 3), dtype)  # numel not a multiple of G
    ref, tri = compress(x, ref_cfg, chunks=3), compress(x, tri_cfg, chunks=3)
    assert tri.buffer.shape == ref.buffer.shape
    assert_payload_close(ref, tri, ref_cfg.format)
    expect = decompress(ref).float()
    got = decompress(as_triton(ref, tri_cfg))
    assert got.shape == x.shape and got.dtype == x.dtype and got.device == x.device
    # per row (rows differ in scale by 1e4): one output rounding apart at most (the
    # interpreter truncates where the GPU rounds to nearest); on a GPU the fp8 tensor-core
    # products of the decode accumulate in fewer bits than fp32 (H200: fp32 outputs within
    # 2e-5 of the reference), far under any bf16 or fp16 rounding
    fp32_tol = 1e-6 if DEVICE.type == "cpu" else 1e-4
    tol = {torch.float32: fp32_tol, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    row_err = (got.float() - expect).norm(dim=1) / expect.norm(dim=1)
    assert (row_err <= tol).all(), row_err


@pytest.mark.parametrize("variant, peers", [("default", 2), ("default", 3), ("default", 8), ("dual", 2),
                                           ("int8", 3), ("e5m2", 8)])
def test_sum_packed_matches_reference(variant, peers):
    """The sum kernel: every peer count's launch step (2, up to 4, more), each format and scale
    layout once (the sum does not transform: Hadamard or not, the same code)."""
    ref_cfg, tri_cfg = configs(128, variant)
    layout = WireLayout.for_tensor(5000, ref_cfg)
    stacked = torch.stack([compress(sample((5, 1000), torch.float32, seed=p), ref_cfg).buffer for p in range(peers)])
    ref = sum_packed(stacked, layout, ref_cfg)
    tri = sum_packed(stacked, layout, tri_cfg)
    assert_payload_close(
        Packed(ref, torch.Size([5000]), torch.float32, ref_cfg, layout),
        Packed(tri, torch.Size([5000]), torch.float32, tri_cfg, layout),
        ref_cfg.format,
    )


def test_sum_packed_of_chunks_decodes_to_the_sum():
    """The two-shot reduce step on chunk layouts: decode(sum) is close to the exact sum."""
    _, cfg = configs(128, "default")
    xs = [sample((4, 777), torch.float32, seed=p) for p in range(4)]
    packs = [compress(x, cfg, chunks=4) for x in xs]
    chunk_layout = packs[0].layout.chunk_layout()
    rows = [torch.stack([p.buffer.view(4, -1)[c] for p in packs]) for c in range(4)]
    summed = torch.cat([sum_packed(r, chunk_layout, cfg) for r in rows])
    out = decompress(Packed(summed, xs[0].shape, torch.float32, cfg, packs[0].layout))
    exact = sum(x.double() for x in xs)
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.06, rel


def test_empty_odd_and_noncontiguous():
    _, cfg = configs(64, "default")
    empty = torch.empty(0, 5, device=DEVICE)
    assert decompress(compress(empty, cfg)).shape == (0, 5)
    base = sample((64, 96), torch.float32)
    for x in (base.t(), base[::3, 1::2], base[:1, :1]):
        got = decompress(compress(x, cfg))
        rel = ((got - x).norm() / x.norm().clamp_min(1e-30)).item()
        assert got.shape == x.shape and rel < 0.04, rel


@pytest.mark.parametrize("variant", ["default", "dual", "int8"])
def test_nonfinite_policies(variant):
    _, cfg = configs(128, variant)
    x = sample((4, 256), torch.float32)
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    bad_groups = torch.tensor([False, False, True, False, False, True, False, False])
    out = decompress(compress(x, cfg)).view(8, 128).cpu()
    assert out[bad_groups].isnan().all()
    assert out[~bad_groups].isfinite().all()
    zero = decompress(compress(x, cfg.replace(nonfinite="zero"))).cpu()
    assert zero.isfinite().all() and zero[1, 5].abs() < 0.1
    with pytest.raises(NonFiniteError):
        compress(x, cfg.replace(nonfinite="raise"))


@pytest.mark.parametrize("fields", [dict(random_signs=True, sign_seed=2), dict(format="e5m2", scales="dual"),
                                    dict(group_size=512, format="int8", hadamard=False)])
def test_kernels_write_the_references_headers(fields):
    """Every encoder writes the chunk header the reference writes (seed 2: a header word with its
    top bit set, negative as the kernels' signed int32), in each chunk, for compress and the sum."""
    ref_cfg = TacoConfig(backend="torch", **fields)
    tri_cfg = ref_cfg.replace(backend="triton")
    x = sample((3, 900), torch.bfloat16)
    ref, tri = compress(x, ref_cfg, chunks=3), compress(x, tri_cfg, chunks=3)
    assert (tri.layout.headers(tri.buffer) == signed_header(ref_cfg)).all()
    assert torch.equal(tri.layout.headers(tri.buffer), ref.layout.headers(ref.buffer))
    chunk = tri.layout.chunk_layout()
    summed = sum_packed(tri.buffer.view(3, -1), chunk, tri_cfg)
    assert (chunk.headers(summed) == signed_header(ref_cfg)).all()
    if fields.get("sign_seed") == 2:
        assert signed_header(ref_cfg) < 0


@pytest.mark.parametrize("variant", ["default", "dual", "int8", "signs"])
def test_finite_fp16_never_decodes_to_inf(variant):
    """fp16 up to 65504 (the round trip's error may carry a value past it): every decoder
    saturates there instead of writing inf, and keeps NaN (on a GPU: the Gluon decoder for
    G = 128 and the tensor-core decoder)."""
    ref_cfg, tri_cfg = configs(128, variant)
    gen = torch.Generator().manual_seed(12)
    x = ((torch.rand(64, 128, generator=gen) * 2 - 1) * 65504).half().to(DEVICE)
    x[0] = 65504
    x[2, 7] = float("nan")
    packed = compress(x, ref_cfg)
    expect = decompress(packed)
    assert not expect.isinf().any()
    for tuning in (Tuning(), Tuning(rows_max_group=0)):
        got = decompress(as_triton(packed, tri_cfg), tuning=tuning)
        assert not got.isinf().any() and torch.equal(got.isnan(), expect.isnan())
        assert ((got.float() - expect.float()).nan_to_num().abs() <= 64).all()  # one fp16 step at 65504: 32


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the once-per-layout check is the GPU's")
def test_a_buffer_of_another_config_raises_on_the_gpu():
    """On a GPU the first buffer of each (config, layout) is checked (a host sync): a config that
    differs from the writer's raises there, for decompress and sum_packed alike."""
    from taco_accel.codec import WireFormatError

    writer = TacoConfig(backend="triton")
    reader = writer.replace(format="int8")
    x = sample((4, 1000), torch.float32)
    packed = compress(x, writer, chunks=2)
    with pytest.raises(WireFormatError, match="format='e4m3'.*but is read with.*format='int8'"):
        decompress(as_triton(packed, reader))
    with pytest.raises(WireFormatError, match="input 0, chunk 0"):
        sum_packed(packed.buffer[None], packed.layout, reader)
    decompress(packed)  # the writer's own config reads it


def test_extreme_magnitudes():
    _, cfg = configs(128, "default")
    for scale in (1e-30, 1e30):
        x = sample((2, 256), torch.float32) * scale
        got = decompress(compress(x, cfg)).double()
        rel = ((got - x.double()).norm() / x.double().norm()).item()  # fp32 norms over/underflow here
        assert math.isfinite(rel) and rel < 0.04, rel
    zeros = torch.zeros(3, 128, device=DEVICE)
    assert torch.equal(decompress(compress(zeros, cfg)), zeros)


# --- compilation for Hopper, without a GPU ---------------------------------------------------
# The interpreter runs the kernels as Python; it does not type-check them the way the compiler
# does (globals, constexpr use, dot shapes). Compiling for sm_90 needs only triton's own
# toolchain, so CI catches a kernel that would not build on the H100/H200. It runs in a fresh
# process because this one defined the kernels for the interpreter: one process for every case
# (triton and torch imported once), each case's result reported on its own.

HOPPER_SCRIPT = """
import sys, json, traceback
import triton
from triton.backends.compiler import GPUTarget
from taco_accel.codec import dispatch
from taco_accel.codec.layout import FORMAT_CODES
from taco_accel.codec.tuning import STEPS, DotMode, Store, Tuning

FMT = {"fp8e4nv": FORMAT_CODES["e4m3"], "fp8e5": FORMAT_CODES["e5m2"], "i8": FORMAT_CODES["int8"]}  # by payload type
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

def compile_for_hopper(source_cls, fn, signature, constexprs, num_warps, **options):
    signature = dict(signature, **{k: "constexpr" for k in constexprs})
    # what the launcher specialises at run time: 16-byte aligned pointers and sizes
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v != "constexpr"}
    return triton.compile(source_cls(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **options})

def tiles(G, dtype, fmt, extra):
    from triton.compiler import ASTSource
    from taco_accel.codec.kernels import triton_kernels as tk

    code = FMT[fmt]
    flags = {"HADAMARD": True, "SIGNS": False, "DUAL": False, **extra}
    sub, bg = min(G, tk.SUB_MAX), max(64, min(8192 // G, 256))
    tuning = Tuning()  # the launcher's warps per kernel for tiles of block_elems (sums of 2 / 4 / 8 inputs: own steps)
    warps = {k: min(8, tuning.launch(k).num_warps * max(1, bg * G // tuning.block_elems)) for k in STEPS}
    ints = dict(chunks="i32", gpc="i32", chunk_bytes="i32", tiles_per_chunk="i32")
    launch = dict(TAIL=8, HEADER=-123456789, NUM_STAGES=2)  # a header word with its top bit set

    def build(fn, signature, constexprs, step):
        return compile_for_hopper(ASTSource, fn, signature, constexprs, warps[step])

    k = build(tk.compress_kernel,
              dict(x_ptr="*" + dtype, q_ptr="*" + fmt, s_ptr="*fp32", sign_ptr="*fp32", numel="i32", **ints),
              dict(G=G, SUB=sub, BG=bg, FMT=code, QMAX=448.0, ADAPTIVE=True, ZERO_NONFINITE=False,
                   DOT_MODE=int(DotMode.BF16X2), EMULATE_ROUND=False, **flags, **launch), "compress")
    assert "mma" in k.asm["ptx"], "the transform should run on the tensor cores"
    assert "cp.async" in k.asm["ptx"], "the next tile's input should be fetched while this one is transformed"
    k = build(tk.decompress_kernel,
              dict(q_ptr="*" + fmt, s_ptr="*fp32", out_ptr="*" + dtype, sign_ptr="*fp32", numel="i32", **ints),
              dict(G=G, SUB=sub, BG=bg, DOT_MODE=int(DotMode.PAYLOAD), NUM_STAGES=2, STORE=int(Store.PLAIN), **flags),
              "decompress")
    payload = ("e4m3", "e5m2", "s8")[code]
    assert f".{payload}.{payload}" in k.asm["ptx"], "decoding should multiply the payload bytes as they are"
    for P, step in ((2, "sum_pair"), (4, "sum"), (8, "sum_many")):
        warps[step] = tuning.launch(step).num_warps  # the sum kernel is not transforming
        build(tk.sum_kernel,
              dict(q_ptr="*" + fmt, s_ptr="*fp32", out_q_ptr="*" + fmt, out_s_ptr="*fp32", input_stride="i32",
                   **ints),
              dict(P=P, G=G, BG=max(16, min(8192 // G, 256)), FMT=code, QMAX=448.0, DUAL=flags["DUAL"], ADAPTIVE=True,
                   EMULATE_ROUND=False, **launch), step)

def gluon_decoder(G, fmt, out, flags):
    from triton.experimental.gluon._runtime import GluonASTSource
    from taco_accel.codec.kernels import gluon_kernels as gk

    NW = Tuning().rows_warps
    constexprs = dict(G=G, NW=NW, Q_BYTES=1, OUT_BYTES=BYTES[out],
                      **{"HADAMARD": True, "SIGNS": False, "DUAL": False, "CHUNKED": False, "WIDE": False, **flags})
    signature = dict(q_ptr="*" + fmt, s_ptr="*fp32", out_ptr="*" + out, sign_ptr="*fp32", numel="i32", gpc="i32",
                     chunk_bytes="i32")
    k = compile_for_hopper(GluonASTSource, gk.decompress_rows_kernel, signature, constexprs, NW)
    ptx = k.asm["ptx"]
    # 16 bytes per lane and access: the payload and the output move whole rows per warp
    assert ptx.count("ld.global.v4") >= G // 16 and ptx.count("st.global.v4") >= G * BYTES[out] // 16, ptx
    assert ".local" not in ptx, "a group per thread should stay in registers"

def gluon_encoder(G, x, fmt, flags):
    from triton.experimental.gluon._runtime import GluonASTSource
    from taco_accel.codec.kernels import gluon_kernels as gk

    NW = Tuning().rows_warps
    words = flags.get("WORDS", False)
    constexprs = dict(G=G, NW=NW, X_BYTES=BYTES[x], FMT=FMT[fmt], QMAX=127.0,
                      **{"WORDS": False, "HADAMARD": True, "SIGNS": False, "DUAL": False, "ADAPTIVE": True,
                         "ZERO_NONFINITE": False, "CHUNKED": False, "WIDE": False, "TAIL": 8, "HEADER": -123456789, "SPLIT": False, **flags})
    signature = dict(x_ptr="*i32" if words else "*" + x, q_ptr="*" + fmt, s_ptr="*fp32", sign_ptr="*fp32",
                     numel="i32", gpc="i32", chunk_bytes="i32", head="i32", body="i32")
    split = constexprs["SPLIT"]
    k = compile_for_hopper(GluonASTSource, gk.compress_rows_kernel, signature, constexprs, NW,
                           **({"maxnreg": Tuning().split_registers} if split else {}))
    ptx = k.asm["ptx"]
    # 16 bytes per lane and access; split: a code with 4 lanes a group and one with 2
    lanes = (4, 2) if split else (1,)
    assert ptx.count("ld.global.v4") >= sum(G * BYTES[x] // 16 // n for n in lanes), ptx
    assert ptx.count("st.global.v4") >= sum(G // 16 // n for n in lanes), ptx
    assert ".local" not in ptx, "a group should stay in registers"
    # the last stages cross lanes by shuffles: log2(4) of them with 4 lanes, one with 2
    assert (ptx.count("shfl.sync.bfly") >= G // 4 * 2 + G // 2) == split, ptx.count("shfl.sync.bfly")

results = {}
for kind, args in json.loads(sys.argv[1]):
    key = json.dumps([kind, args])
    if kind != "tiles" and not dispatch.gluon_available():
        results[key] = "skip: this triton has no Gluon"
        continue
    try:
        {"tiles": tiles, "gluon_decoder": gluon_decoder, "gluon_encoder": gluon_encoder}[kind](*args)
        results[key] = "compiled"
    except Exception:
        results[key] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results))
"""

# the tile kernels (compress, decompress, the three sums) per payload format, with each flag
HOPPER_TILES = [[128, "bf16", "fp8e4nv", {}], [512, "fp32", "fp8e5", dict(DUAL=True, SIGNS=True)],
                [32, "fp16", "i8", {}]]
# the Gluon decoder and encoder at every group size they serve, each payload format, input and
# output type, with signs, dual scales, chunks, 64-bit offsets and bf16 read as words or as values
GLUON_DECODERS = [[128, "fp8e4nv", "bf16", {}], [64, "fp8e5", "fp32", dict(HADAMARD=False, CHUNKED=True)],
                  [32, "i8", "fp16", dict(DUAL=True, SIGNS=True, WIDE=True)],
                  [128, "fp8e4nv", "fp32", dict(DUAL=True, SIGNS=True, CHUNKED=True)]]
GLUON_ENCODERS = [[128, "bf16", "fp8e4nv", dict(WORDS=True)], [128, "bf16", "fp8e4nv", dict(DUAL=True, ADAPTIVE=False)],
                  [128, "bf16", "fp8e4nv", dict(WORDS=True, SPLIT=True)],
                  [128, "fp32", "i8", dict(SPLIT=True, DUAL=True, SIGNS=True, CHUNKED=True, ZERO_NONFINITE=True)],
                  [64, "fp32", "fp8e5", dict(DUAL=True, SIGNS=True, CHUNKED=True)],
                  [32, "bf16", "i8", dict(WORDS=True, SIGNS=True, ZERO_NONFINITE=True, WIDE=True, CHUNKED=True)],
                  [128, "fp16", "i8", dict(HADAMARD=False, ZERO_NONFINITE=True)]]
HOPPER_CASES = ([["tiles", c] for c in HOPPER_TILES] + [["gluon_decoder", c] for c in GLUON_DECODERS]
                + [["gluon_encoder", c] for c in GLUON_ENCODERS])


@pytest.fixture(scope="module")
def hopper_builds() -> dict:
    """Every case of HOPPER_CASES compiled for sm_90 in one fresh process: {case: "compiled",
    "skip: ..." or the error}."""
    import json
    import os
    import subprocess
    import sys

    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this triton cannot compile ahead of time")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", HOPPER_SCRIPT, json.dumps(HOPPER_CASES)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def _built(builds: dict, kind: str, case) -> None:
    import json

    result = builds[json.dumps([kind, case])]
    if result.startswith("skip: "):
        pytest.skip(result.removeprefix("skip: "))
    assert result == "compiled", result


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU run compiles them for real")
@pytest.mark.parametrize("case", HOPPER_TILES, ids=["G128-bf16-e4m3", "G512-fp32-e5m2-dual-signs", "G32-fp16-int8"])
def test_kernels_compile_for_hopper(hopper_builds, case):
    _built(hopper_builds, "tiles", case)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU run compiles them for real")
@pytest.mark.parametrize("kind, case", [("gluon_decoder", c) for c in GLUON_DECODERS]
                         + [("gluon_encoder", c) for c in GLUON_ENCODERS])
def test_gluon_kernels_compile_for_hopper(hopper_builds, kind, case):
    """The one-group-per-thread decoder and encoder (Gluon, which the interpreter cannot run)."""
    _built(hopper_builds, kind, case)


# (group size, variant, chunks, output dtype): every group size the Gluon decoder serves, every
# variant's flags, chunked and not, every output type; one compiled kernel pair per case
DECODER_CASES = [
    (32, "default", 1, torch.bfloat16), (64, "e5m2", 3, torch.float32), (128, "default", 3, torch.float16),
    (128, "dual", 1, torch.float32), (128, "int8", 1, torch.bfloat16), (128, "no-hadamard", 3, torch.float32),
    (32, "signs", 3, torch.float16), (128, "signs", 1, torch.bfloat16), (64, "dual-no-adaptive", 1, torch.float16),
]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("group_size, variant, chunks, dtype", DECODER_CASES,
                         ids=[f"G{g}-{v}-{c}-{str(d).removeprefix('torch.')}" for g, v, c, d in DECODER_CASES])
def test_gluon_decoder_matches_tensor_core_decoder(group_size, variant, chunks, dtype):
    """Both decoders of one buffer (1 or 3 chunks, a partial last group, a NaN group) agree:
    equal NaNs, values within the tensor-core kernel's fp8 accumulation (a few 1e-5 relative)
    and a few values one output rounding step apart."""
    x = sample((6, (3 * 45 * group_size - 3) // 6), torch.float32).reshape(-1)
    x[5] = float("nan")
    tiles_only = Tuning(rows_max_group=0)
    ref_cfg, tri_cfg = configs(group_size, variant)
    layout = WireLayout.for_tensor(x.numel(), tri_cfg, chunks)
    assert dispatch.select("decompress", tri_cfg, x.device, layout, Tuning()) is Kernel.ROWS
    assert dispatch.select("decompress", tri_cfg, x.device, layout, tiles_only) is Kernel.TILES
    packed = as_triton(compress(x.to(dtype), ref_cfg, chunks=chunks), tri_cfg)
    rows = torch.full((x.numel(),), 7.0, dtype=dtype, device=DEVICE)
    decompress(packed, rows)
    tiles = torch.full_like(rows, 7.0)
    decompress(packed, tiles, tuning=tiles_only)
    assert torch.equal(rows.isnan(), tiles.isnan()) and rows[:group_size].isnan().all()
    rows, tiles = rows.float().nan_to_num(), tiles.float().nan_to_num()
    # fp32: the tensor-core decoder's fp8 products accumulate in fewer bits (H200: 2e-5); bf16 and
    # fp16: a few values one output rounding (2**-8, 2**-11) apart
    tol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert (rows - tiles).norm() <= tol * tiles.norm()


# (group size, schedule, variant, chunks, inputs): the one-lane encoder at each group size, the
# split encoder (4 and 2 lanes a group) and its short waves; every variant's flags at least once
# per schedule kind where they change the kernel (the transform's flags under both); every input
# kind: fp32, fp16, bf16 read as words (aligned), as values (odd start or length), nonfinite="zero"
ENCODER_CASES = [
    (32, "one-lane", "signs", 3, ("bf16-words", "fp16")),
    (64, "one-lane", "e5m2", 1, ("fp32", "bf16-values")),
    (128, "one-lane", "default", 1, ("fp32", "fp16", "bf16-words", "bf16-values", "bf16-odd", "zero")),
    (128, "one-lane", "int8", 3, ("bf16-words", "zero")),
    (128, "one-lane", "dual-no-adaptive", 1, ("fp16",)),
    (128, "split", "dual", 3, ("fp32", "bf16-words", "bf16-values")),
    (128, "split", "no-hadamard", 1, ("bf16-words", "zero")),
    (128, "split", "signs", 1, ("fp16", "bf16-odd")),
    (128, "split", "int8", 3, ("fp32",)),
    (128, "split-short-waves", "default", 1, ("bf16-words", "fp32")),
    (128, "split-short-waves", "e5m2", 3, ("bf16-words",)),
]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("group_size, schedule, variant, chunks, inputs", ENCODER_CASES,
                         ids=[f"G{g}-{s}-{v}-{c}" for g, s, v, c, _ in ENCODER_CASES])
def test_gluon_encoder_matches_reference(group_size, schedule, variant, chunks, inputs):
    """The Gluon encoder, a group in one lane or split over 4 and 2 lanes (`split_schedule`; at
    this size all 4-lane, so also with waves of 66 groups: 4-lane head, 2-lane body, 4-lane
    tail), against the reference (1 or 3 chunks, a partial last group, a NaN group, an Inf
    group, a group past fp32's range once transformed). The payload equals the reference's but
    for values at a rounding tie; each chunk's header and padding are written."""
    from taco_accel.codec.kernels import gluon_kernels

    split = schedule != "one-lane"
    tuning = Tuning(split_max_groups=2**40 if split else 0)
    if schedule == "split-short-waves":  # a wave of 66 groups of 4-lane programs, whatever the SM count
        tuning = tuning.replace(split_warps_per_sm=66 / 8 / sm_count(DEVICE))
    x = sample((6, (3 * 45 * group_size - 4) // 6), torch.float32).reshape(-1)
    x[5] = float("nan")
    x[group_size * 3 + 1] = -float("inf")
    x[group_size * 7: group_size * 8] = 3e38
    odd = sample((1, 3 * group_size + 3), torch.float32).reshape(-1)
    words = x.to(torch.bfloat16)
    assert gluon_kernels.reads_words(words)
    assert not gluon_kernels.reads_words(words[1:-1]) and not gluon_kernels.reads_words(odd.to(torch.bfloat16))
    ref_cfg, tri_cfg = configs(group_size, variant)
    layout = WireLayout.for_tensor(x.numel(), tri_cfg, chunks)
    expected = Kernel.SPLIT_ROWS if split else Kernel.ROWS
    assert dispatch.select("compress", tri_cfg, x.device, layout, tuning) is expected
    if schedule == "split-short-waves":
        head, body, _ = gluon_kernels.split_schedule(layout, sm_count(x.device), tuning)
        assert body > 0 and head + body < layout.groups_per_chunk and (head > 0) == (chunks == 1)
    values = {"fp32": (x, tri_cfg), "fp16": (x.half(), tri_cfg), "bf16-words": (words, tri_cfg),
              "bf16-values": (words[1:-1], tri_cfg), "bf16-odd": (odd.to(torch.bfloat16), tri_cfg),
              "zero": (x, tri_cfg.replace(nonfinite="zero"))}
    for name in inputs:
        v, cfg = values[name]
        ref = compress(v, ref_cfg.replace(nonfinite=cfg.nonfinite), chunks=chunks)
        got = compress(v, cfg, chunks=chunks, tuning=tuning)
        assert_payload_close(ref, got, cfg.format)
        assert not ref.layout.padding(got.buffer).any(), name
        assert (ref.layout.headers(got.buffer) == signed_header(cfg)).all(), name


# --- which kernel runs: dispatch.select's table ---------------------------------------------------

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture
def compiled(monkeypatch):
    """`dispatch.select` as on a machine with an NVIDIA GPU and Gluon (no interpreter): the table's
    rows hold on any machine, since select only reads the device type and these facts."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "gluon_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(dispatch, "failed_builds", {})


def layout_of(numel: int, group_size: int = 128, chunks: int = 1) -> WireLayout:
    return WireLayout.for_tensor(numel, TacoConfig(group_size=group_size), chunks)


@pytest.mark.parametrize("op, backend, device, group_size, numel, expected", [
    ("compress", "torch", CUDA, 128, 2**20, Kernel.REFERENCE),
    ("sum", "auto", CPU, 128, 2**20, Kernel.REFERENCE),
    ("compress", "auto", CUDA, 128, 2**20, Kernel.SPLIT_ROWS),
    ("compress", "triton", CUDA, 128, 6 * 2**23, Kernel.SPLIT_ROWS),  # 6 * 2**16 groups: the limit
    ("compress", "auto", CUDA, 128, 6 * 2**23 + 1, Kernel.ROWS),
    ("compress", "auto", CUDA, 64, 2**20, Kernel.ROWS),
    ("compress", "auto", CUDA, 32, 2**30, Kernel.ROWS),
    ("decompress", "auto", CUDA, 128, 2**20, Kernel.ROWS),
    ("decompress", "auto", CUDA, 256, 2**20, Kernel.TILES),
    ("compress", "auto", CUDA, 512, 2**20, Kernel.TILES),
    ("sum", "auto", CUDA, 128, 2**20, Kernel.TILES),
    ("sum", "triton", CUDA, 32, 2**20, Kernel.TILES),
])
def test_dispatch_table(compiled, op, backend, device, group_size, numel, expected):
    config = TacoConfig(group_size=group_size, backend=backend)
    assert dispatch.select(op, config, device, layout_of(numel, group_size), Tuning()) is expected


def test_dispatch_split_counts_the_groups_of_every_chunk(compiled):
    """The split limit is on the groups of all chunks together, and only G = 128 splits."""
    limit = Tuning().split_max_groups
    config = TacoConfig()

    def kernel(numel, chunks=1, group_size=128, tuning=Tuning()):
        layout = layout_of(numel, group_size, chunks)
        return dispatch.select("compress", config.replace(group_size=group_size), CUDA, layout, tuning)

    assert kernel(limit * 128) is Kernel.SPLIT_ROWS
    assert kernel(limit * 128 + 1) is Kernel.ROWS
    assert kernel(limit * 128 + 1024, chunks=8) is Kernel.ROWS
    assert kernel(4096, group_size=64) is Kernel.ROWS
    assert kernel(4096, tuning=Tuning(split_max_groups=0)) is Kernel.ROWS


def test_dispatch_follows_the_tuning_it_is_given(compiled):
    """rows_max_group = 0 sends every group size to the tensor-core kernels, splits included."""
    tiles_only = Tuning(rows_max_group=0)
    for op in ("compress", "decompress"):
        for g in (32, 128):
            assert dispatch.select(op, TacoConfig(group_size=g), CUDA, layout_of(4096, g), tiles_only) is Kernel.TILES
    assert dispatch.select("compress", TacoConfig(group_size=64), CUDA, layout_of(4096, 64),
                           Tuning(rows_max_group=32)) is Kernel.TILES


def test_dispatch_on_other_platforms(compiled, monkeypatch):
    """No Gluon, ROCm or the interpreter: the tensor-core kernels; backend='triton' where this
    machine cannot run them: a RuntimeError that says how to fix it."""
    config, layout = TacoConfig(backend="triton"), layout_of(4096)
    monkeypatch.setattr(dispatch, "gluon_available", lambda: False)
    assert dispatch.select("compress", config, CUDA, layout, Tuning()) is Kernel.TILES
    monkeypatch.setattr(dispatch, "gluon_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert dispatch.select("decompress", config, CUDA, layout, Tuning()) is Kernel.TILES
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.select("compress", config, CPU, layout, Tuning())
    monkeypatch.setattr(dispatch, "interpreting", lambda: True)
    assert dispatch.select("compress", config, CPU, layout, Tuning()) is Kernel.TILES
    assert dispatch.select("compress", config, CUDA, layout, Tuning()) is Kernel.TILES
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        dispatch.select("compress", config, CUDA, layout, Tuning())
    assert dispatch.select("compress", config.replace(backend="auto"), CUDA, layout, Tuning()) is Kernel.REFERENCE
    with pytest.raises(ValueError, match="unknown codec operation"):
        dispatch.select("encode", config, CUDA, layout, Tuning())


def test_a_kernel_that_fails_to_build_falls_back_once_with_one_warning(compiled, monkeypatch):
    """A Gluon kernel that does not compile: the call writes what the tensor-core kernel writes,
    one warning names the kernel and the compiler's reason, and select skips that kernel from
    then on (the next row of its table matches; the decoder's kernel is not affected)."""
    import warnings

    import triton

    from taco_accel.codec.kernels import gluon_kernels

    select = dispatch.select
    # the GPU's choice for these CPU tensors, which then run in the interpreter
    monkeypatch.setattr(dispatch, "select", lambda op, cfg, device, layout, tuning: select(op, cfg, CUDA, layout, tuning))
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)
    calls = []

    def broken(*args):
        calls.append(args)
        raise triton.compiler.errors.CompilationError("src", None, "gl.foo is not defined")

    monkeypatch.setattr(gluon_kernels, "compress_rows_into", broken)
    config = TacoConfig(backend="triton")
    x = sample((3, 1000), torch.float32)
    with pytest.warns(RuntimeWarning, match=r"Gluon kernel for compress \(gluon, a group over 2-4 lanes\).*gl.foo is"):
        got = compress(x, config)
    assert len(calls) == 1 and calls[0][-1] == 132  # the split encoder was asked first
    assert torch.equal(got.buffer, compress(x, config, tuning=Tuning(rows_max_group=0)).buffer)
    assert dispatch.failed_builds == {(Kernel.SPLIT_ROWS, "compress"): "gl.foo is not defined"}
    layout = got.layout
    assert select("compress", config, CUDA, layout, Tuning()) is Kernel.ROWS  # the next row of the table
    assert select("decompress", config, CUDA, layout, Tuning()) is Kernel.ROWS
    with pytest.warns(RuntimeWarning, match=r"compress \(gluon, a group per lane\)"):  # ROWS fails too
        compress(x, config)
    assert len(calls) == 2 and calls[1][-1] == 0
    with warnings.catch_warnings():
        # no further warning: neither Gluon encoder is tried again (an older Triton's interpreter
        # may warn about NumPy meanwhile)
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(compress(x, config).buffer, got.buffer)
    assert len(calls) == 2 and select("compress", config, CUDA, layout, Tuning()) is Kernel.TILES


@pytest.mark.parametrize("sms", [1, 132, 1 / 16])
@pytest.mark.parametrize("numel, chunks", [(1, 1), (127, 1), (128 * 16, 1), (128 * 45 * 3 - 4, 3), (2**24, 1),
                                           (2**24 + 5, 8), (128 * 100 + 64, 8), (128 * 9, 8), (3 * 2**20 + 1, 2)])
def test_split_schedule_codes_each_group_once_and_reads_whole_groups_unmasked(numel, chunks, sms):
    """`gluon_kernels.split_schedule` as the kernel uses it (programs of 8 groups over 4 lanes,
    with masks, before ``head`` and after ``head + body``; of 16 over 2 lanes, without masks,
    between): every group of every chunk coded by exactly one program, the unmasked ones whole
    groups of the input in every chunk, tiles aligned."""
    from taco_accel.codec.kernels import gluon_kernels as gk

    layout = WireLayout.for_tensor(numel, TacoConfig(), chunks)
    gpc = layout.groups_per_chunk
    head, body, programs = gk.split_schedule(layout, sms, Tuning())
    assert head % 16 == 0 and body % 16 == 0 and 0 <= head and 0 <= body and head + body <= gpc
    last_values = numel - (layout.chunks - 1) * gpc * 128  # the last chunk holds the fewest values
    assert (head + body) * 128 <= max(0, last_values), "the body must not read past the input"
    coded = []
    for p in range(programs):
        if head // 8 <= p < head // 8 + body // 16:
            coded += range(head + (p - head // 8) * 16, head + (p - head // 8) * 16 + 16)
        else:
            r0 = p * 8 if p < head // 8 else head + body + (p - head // 8 - body // 16) * 8
            coded += [g for g in range(r0, r0 + 8) if g < gpc]  # masked
    assert sorted(coded) == list(range(gpc))


def test_tuning_is_a_frozen_value_with_every_launch_step():
    """The launcher looks each kernel's launch up by step name (compress, decompress and the three
    sums); tuning cannot be changed in place, only replaced."""
    import dataclasses

    from taco_accel.codec import Launch
    from taco_accel.codec.tuning import STEPS

    tuning = Tuning()
    for step in STEPS:
        assert isinstance(tuning.launch(step), Launch)
    with pytest.raises(ValueError, match="unknown kernel step"):
        tuning.launch("sum_all")
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.block_elems = 4096
    assert tuning.replace(block_elems=4096).block_elems == 4096 and tuning.block_elems == 8192
    assert hash(tuning) == hash(Tuning())  # usable as a cache key


@pytest.mark.parametrize("group_size", [64, 256])
def test_evict_first_stores_match_plain_stores(group_size):
    """Evict-first stores of the decoded values write what plain stores write."""
    from taco_accel.codec.tuning import Store

    torch.manual_seed(0)
    cfg = TacoConfig(group_size=group_size, backend="triton")
    tiles = Tuning(rows_max_group=0)  # the tensor-core decoder, which has the setting
    for numel in (64 * group_size + 5 * group_size, 3 * group_size + 7):  # a partial tile; a partial group
        packed = compress(torch.randn(numel, device=DEVICE).to(torch.bfloat16), cfg)
        plain = decompress(packed, tuning=tiles)
        assert torch.equal(decompress(packed, tuning=tiles.replace(stores=Store.STREAM)), plain)


@pytest.mark.parametrize("group_size", [64, 128])
def test_decompress_tiles_end_at_chunk_ends(group_size):
    """Decompress walks each chunk in tiles of its own (the last one partial): every value is
    written once, from its own chunk's payload and scales."""
    torch.manual_seed(0)
    ref_cfg, tri_cfg = configs(group_size, "dual")
    numel = 2 * 70 * group_size + 5  # 2 chunks of 71 groups: 2 tiles each, the second partial
    packed = compress(torch.randn(numel, device=DEVICE), ref_cfg, chunks=2)
    assert packed.layout.groups_per_chunk == 71
    expect = decompress(packed)
    got = torch.full_like(expect, float("nan"))
    decompress(as_triton(packed, tri_cfg), got)
    assert not got.isnan().any()
    assert (got - expect).norm() <= 1e-4 * expect.norm()


@pytest.mark.parametrize("group_size, variant", [(64, "dual"), (128, "default")])
def test_compress_and_sum_tiles_end_at_chunk_ends(group_size, variant):
    """Compress and the sum walk each chunk in tiles of their own too (71 groups per chunk: at
    G = 128 two tiles, the second partial): into a poisoned buffer they write every payload
    byte and scale as the reference does, each chunk's header and zeros into its padding."""
    from taco_accel.codec.kernels import triton_kernels as tk

    ref_cfg, tri_cfg = configs(group_size, variant)
    x = sample((5, (3 * 71 * group_size - 1) // 5), torch.float32).reshape(-1)  # rows 1e4 apart in scale
    numel = x.numel()  # 3 chunks of 71 groups, the last group partial
    layout = WireLayout.for_tensor(numel, ref_cfg, chunks=3)
    assert layout.groups_per_chunk == 71
    header = signed_header(tri_cfg)
    ref = compress(x, ref_cfg, chunks=3)
    poisoned = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8, device=DEVICE)
    tk.compress_into(x, poisoned, layout, tri_cfg, Tuning())
    assert_payload_close(ref, Packed(poisoned, x.shape, x.dtype, tri_cfg, layout), ref_cfg.format)
    assert (layout.padding(poisoned) == 0).all() and (layout.headers(poisoned) == header).all()

    chunk_layout = layout.chunk_layout()
    stacked = ref.buffer.view(3, -1)  # the three chunks as the inputs of one reduce step
    expect = sum_packed(stacked, chunk_layout, ref_cfg)
    summed = torch.full_like(expect, 0xAB)
    tk.sum_into(stacked, chunk_layout, tri_cfg, summed, Tuning())
    as_packed = [Packed(b, torch.Size([chunk_layout.numel]), torch.float32, c, chunk_layout)
                 for b, c in ((expect, ref_cfg), (summed, tri_cfg))]
    assert_payload_close(*as_packed, ref_cfg.format)
    assert (chunk_layout.padding(summed) == 0).all() and (chunk_layout.headers(summed) == header).all()
