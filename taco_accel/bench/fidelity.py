"""Fidelity of the TACO codec and its ablations on tensors like those TP collectives carry.

Run ``python -m taco_accel.bench.fidelity`` (CPU, seconds; the reference codec). It prints Markdown tables of
round-trip errors, in percent:

- ``rms``: energy-weighted relative RMS error over the whole tensor, ``||x_hat - x|| / ||x||``;
- ``row``: the mean over rows of the same ratio per row (rows of very different scale count
  alike, which is where per-tensor scaling fails);
- ``max``: ``max|x_hat - x| / max|x|``.

Variants: the TACO default (single scale), the paper's dual scales, naive per-tensor FP8 E4M3
(`naive_per_tensor`, the baseline TACO exists to beat), and ablations (no Hadamard, no adaptive
scale, random signs, INT8, E5M2), at several group sizes G, on synthetic tensors and on
activations and gradients captured from a small randomly initialised Qwen2 model.

No asserts: the bounds are checked by ``tests/test_codec.py``; this module reports figures
(``benchmarks/results/fidelity.md``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from taco_accel.codec import TacoConfig, compress, decompress
from taco_accel.codec.config import QMAX
from taco_accel.codec.layout import PAYLOAD_DTYPES

DEFAULT_GROUP_SIZES = (64, 128, 256)

# Name -> TacoConfig fields changed from the defaults (None: naive per-tensor FP8 E4M3).
VARIANTS: dict[str, dict | None] = {
    "TACO default (single scale)": {},
    "TACO dual scales (paper)": {"scales": "dual"},
    "naive per-tensor FP8 E4M3": None,
    "per-group FP8, no Hadamard": {"hadamard": False},
    "dual, no adaptive scale": {"scales": "dual", "adaptive_scale": False},
    "Hadamard + random signs": {"random_signs": True},
    "per-group INT8 (Hadamard)": {"format": "int8"},
    "per-group INT8, no Hadamard": {"format": "int8", "hadamard": False},
    "E5M2 (Hadamard)": {"format": "e5m2"},
}


# --- codecs -----------------------------------------------------------------------------------


def naive_per_tensor(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Round trip of ``x`` through FP8 with one fp32 scale for the whole tensor.

    ``scale = max|x| / FP8_MAX``, ``q = fp8(clamp(x / scale))`` (round to nearest even), decode
    ``q * scale``. This is what TACO improves on: one large value sets the scale for all, and
    rows far below it fall into FP8's subnormals or flush to zero.
    """
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"naive_per_tensor supports fmt 'e4m3' or 'e5m2', got {fmt!r}")
    qmax = QMAX[fmt]
    x32 = x.detach().float()
    if x32.numel() == 0:
        return x.detach().clone()
    scale = x32.abs().amax() / qmax
    if scale == 0:
        return torch.zeros_like(x)
    q = (x32 / scale).clamp(-qmax, qmax).to(PAYLOAD_DTYPES[fmt])
    return (q.float() * scale).to(x.dtype)


def variant_roundtrip(fields: dict | None, group_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The round trip ``x -> x_hat`` of one entry of `VARIANTS` at group size ``group_size``."""
    if fields is None:
        return naive_per_tensor
    config = TacoConfig(group_size=group_size, backend="torch", **fields)
    return lambda x: decompress(compress(x, config))


# --- metrics ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fidelity:
    """Round-trip errors of one tensor, as fractions (see the module docstring)."""

    rms: float
    row: float
    max: float


def measure(x: torch.Tensor, x_hat: torch.Tensor) -> Fidelity:
    """Errors of ``x_hat`` against ``x`` in float64; rows are slices along the last dimension."""
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    err = x_hat.detach().double().reshape(x64.shape) - x64
    row_norm = x64.norm(dim=1)
    live = row_norm > 0
    row_rel = err.norm(dim=1)[live] / row_norm[live]
    return Fidelity(
        rms=float(err.norm() / x64.norm()),
        row=float(row_rel.mean()) if live.any() else 0.0,
        max=float(err.abs().max() / x64.abs().max()),
    )


# --- synthetic tensors ------------------------------------------------------------------------


def _student_t(shape, df: int, gen: torch.Generator) -> torch.Tensor:
    """Student-t samples with integer ``df``: ``z / sqrt(chi2_df / df)``."""
    z = torch.randn(shape, generator=gen)
    chi2 = torch.randn((df, *shape), generator=gen).square().sum(0)
    return z / (chi2 / df).sqrt()


def synthetic_tensors(rows: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """TP-like fp32 tensors [rows, hidden], each named by what it imitates."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, hidden)
    gaussian = torch.randn(shape, generator=gen) * 0.01
    heavy = _student_t(shape, 3, gen) * 0.01
    return {
        "near-zero Gaussian (std 0.01)": gaussian,
        "heavy-tailed Student-t (df 3)": heavy,
        "rows of scale 1 .. 1e-5": rows_of_scale(rows, hidden, 5, gen),
        "sparse gradient spikes": gradient_spikes(rows, hidden, gen),
        "outlier channels (LLM activations)": outlier_channels(rows, hidden, gen),
    }


def rows_of_scale(rows: int, hidden: int, decades: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian rows whose std cycles through 1, 0.1, ..., 10**-decades (row r: 10**-(r % (decades + 1)))."""
    exponent = torch.arange(rows) % (decades + 1)
    return torch.randn(rows, hidden, generator=gen) * (10.0 ** -exponent.double()).float()[:, None]


def gradient_spikes(rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of tiny values (std 1e-4); one row in 8 carries 4 spikes of magnitude 1..10."""
    x = torch.randn(rows, hidden, generator=gen) * 1e-4
    spiky = torch.arange(0, rows, 8)
    cols = torch.randint(0, hidden, (len(spiky), 4), generator=gen)
    values = torch.empty(len(spiky), 4).uniform_(1, 10, generator=gen)
    signs = torch.randint(0, 2, (len(spiky), 4), generator=gen) * 2 - 1
    x[spiky[:, None], cols] = values * signs
    return x


def outlier_channels(rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Unit Gaussian activations with 1% of the channels (columns) 50x larger, as in LLMs."""
    x = torch.randn(rows, hidden, generator=gen)
    channels = torch.randperm(hidden, generator=gen)[: max(1, hidden // 100)]
    x[:, channels] *= 50.0
    return x


# --- tensors captured from a model ------------------------------------------------------------


def stdlib_bytes(count: int) -> list[int]:
    """``count`` bytes of the Python standard library's own source (offline real text)."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    data = source.read_bytes()
    start = len(data) // 3  # past the license header and module docstring: code
    return list(data[start : start + count])


def captured_tensors(seed: int, tokens: int = 512, hidden: int = 512, layers: int = 2) -> dict[str, torch.Tensor]:
    """Tensors the TP all-reduces would carry, from a tiny random-init Qwen2 on stdlib text.

    Forward: the outputs of ``o_proj`` and ``down_proj`` (row-parallel layers). Backward: the
    gradients w.r.t. the inputs of q/k/v and of gate/up (column-parallel layers), i.e. w.r.t.
    the outputs of ``input_layernorm`` and ``post_attention_layernorm``. Each entry stacks all
    layers as [layers * tokens, hidden]; the model runs in fp32 on the CPU.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=tokens,
    )
    with torch.random.fork_rng():  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    store: dict[str, list[torch.Tensor]] = {}
    handles = _capture_hooks(model, store)
    ids = torch.tensor(stdlib_bytes(tokens)).view(2, -1)  # (batch 2, seq tokens/2)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return {name: torch.cat([t.reshape(-1, hidden) for t in ts]) for name, ts in store.items()}


def _capture_hooks(model: torch.nn.Module, store: dict[str, list[torch.Tensor]]) -> list:
    """Forward / backward hooks on every decoder layer that append to ``store``."""

    def forward_out(name):
        return lambda module, args, out: store.setdefault(name, []).append(out.detach().clone())

    def backward_out(name):
        return lambda module, grad_in, grad_out: store.setdefault(name, []).append(grad_out[0].detach().clone())

    handles = []
    for layer in model.model.layers:
        attn_norm, mlp_norm = layer.input_layernorm, layer.post_attention_layernorm
        handles += [
            layer.self_attn.o_proj.register_forward_hook(forward_out("model: o_proj output (fwd)")),
            layer.mlp.down_proj.register_forward_hook(forward_out("model: down_proj output (fwd)")),
            attn_norm.register_full_backward_hook(backward_out("model: q/k/v input grad (bwd)")),
            mlp_norm.register_full_backward_hook(backward_out("model: gate/up input grad (bwd)")),
        ]
    return handles


# --- the report -------------------------------------------------------------------------------


def fidelity_table(x: torch.Tensor, group_sizes: tuple[int, ...]) -> list[tuple[str, float, list[Fidelity]]]:
    """Per variant: (name, wire bytes per element at G=128, one `Fidelity` per group size)."""
    rows = []
    for name, fields in VARIANTS.items():
        figures = [measure(x, variant_roundtrip(fields, g)(x)) for g in group_sizes]
        bpe = 1.0 if fields is None else TacoConfig(**fields).bytes_per_element
        rows.append((name, bpe, figures))
    return rows


def format_table(title: str, x: torch.Tensor, group_sizes: tuple[int, ...]) -> str:
    """One Markdown table: a row per variant, a column per group size ("rms / row / max" %)."""
    lines = [
        f"### {title} {list(x.shape)}",
        "",
        "| variant | B/elt @G=128 | " + " | ".join(f"G={g}: rms / row / max %" for g in group_sizes) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in group_sizes) + " |",
    ]
    for name, bpe, figures in fidelity_table(x, group_sizes):
        cells = [f"{100 * f.rms:.3g} / {100 * f.row:.3g} / {100 * f.max:.3g}" for f in figures]
        lines.append(f"| {name} | {bpe:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _roundtrip(x: torch.Tensor, **fields) -> torch.Tensor:
    return decompress(compress(x, TacoConfig(backend="torch", **fields)))


def _compare(x: torch.Tensor, a: dict, b: dict) -> str:
    """"payload bytes differing % / max decoded difference relative to max|x|" of two configs."""
    pa, pb = compress(x, TacoConfig(backend="torch", **a)), compress(x, TacoConfig(backend="torch", **b))
    fmt = pa.config.format
    qa, qb = (p.layout.payload(p.buffer, fmt).view(torch.uint8) for p in (pa, pb))
    differ = float((qa != qb).double().mean())
    gap = float((decompress(pa) - decompress(pb)).abs().max() / x.abs().max())
    return f"{100 * differ:.2g}% / {gap:.1e}"


def agreement_table(tensors: dict[str, torch.Tensor]) -> str:
    """How far the scale layouts and the adaptive scale move the codec's output, at G=128.

    For each pair of configs: the fraction of payload bytes that differ, and the largest
    difference of the decoded values relative to ``max|x|``. The same math up to fp32
    rounding shows as a tiny fraction of bytes one step apart and a difference near 1e-7.
    """
    lines = [
        "| tensor | single vs dual: payload differing / max decoded diff | dual: adaptive vs none: same |",
        "| --- | ---: | ---: |",
    ]
    dual, plain = {"scales": "dual"}, {"scales": "dual", "adaptive_scale": False}
    for name, x in tensors.items():
        lines.append(f"| {name} | {_compare(x, {}, dual)} | {_compare(x, dual, plain)} |")
    return "\n".join(lines)


def tiny_magnitude_table(seed: int) -> str:
    """Where the adaptive scale can matter: fp32 values near the underflow range.

    The codec flushes a group to zero when its largest transformed value is below
    ``codec.kernels.reference.TINY_AMAX`` (1e-33), where ``qmax / amax`` or the scale would leave fp32's
    normal range; the dual layout's ``a`` (clamped at 1e3) lifts groups by three decades first.
    """
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 1024, generator=gen)
    variants = ({}, {"scales": "dual"}, {"scales": "dual", "adaptive_scale": False})
    lines = ["| Gaussian std | single rms % | dual rms % | dual, no adaptive rms % |", "| --- | ---: | ---: | ---: |"]
    for std in (1e-30, 1e-33, 1e-34, 1e-36, 1e-37, 1e-38):
        x = base * std
        errs = [measure(x, _roundtrip(x, **fields)).rms for fields in variants]
        lines.append(f"| {std:.0e} | " + " | ".join(f"{100 * e:.3g}" for e in errs) + " |")
    return "\n".join(lines)


def report(group_sizes: tuple[int, ...], rows: int, hidden: int, seed: int, with_model: bool) -> str:
    """The whole Markdown report."""
    tensors = synthetic_tensors(rows, hidden, seed)
    if with_model:
        tensors.update(captured_tensors(seed))
    sections = [format_table(name, x, group_sizes) for name, x in tensors.items()]
    sections.append("### Scale layouts and the adaptive scale, G=128\n\n" + agreement_table(tensors))
    sections.append("### Tiny magnitudes (fp32 underflow range), G=128\n\n" + tiny_magnitude_table(seed))
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=list(DEFAULT_GROUP_SIZES))
    parser.add_argument("--rows", type=int, default=256, help="rows of each synthetic tensor")
    parser.add_argument("--hidden", type=int, default=1024, help="last dimension of each synthetic tensor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-model", action="store_true", help="skip the tensors captured from Qwen2")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    text = report(tuple(args.group_sizes), args.rows, args.hidden, args.seed, not args.no_model)
    command = "python -m taco_accel.bench.fidelity " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"<!-- {command.strip()} | torch {torch.__version__} | {time.perf_counter() - start:.1f} s -->\n")
    print(text)


if __name__ == "__main__":
    main()
