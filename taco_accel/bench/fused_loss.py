"""The lm head and its loss, forward and backward, at a real vocabulary: time, peak memory, host
syncs and gradient error of the unfused head (the logits, then the cross-entropy; eager and
compiled), ours fused (`tp.fused_cross_entropy`, eager and with its chunk arithmetic compiled) and
the libraries that fuse it for one rank: liger-kernel's fused linear cross-entropy, Apple's
cut-cross-entropy (its default ``filter_eps``, which skips small gradient entries, and exact) and
torch's own ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13, chunked).

    python -m taco_accel.bench.fused_loss                                # GPU: Qwen2.5-0.5B's head, 4 x 1024 tokens, bf16
    python -m taco_accel.bench.fused_loss --device cpu --tokens 1024     # CPU: fp32, peak resident memory

Each variant runs in a process of its own on the same inputs (x: tokens x hidden, the head W:
vocab x hidden, fp32 leaves; targets uniform over the vocabulary), the summed loss. On CUDA: bf16
autocast over the fp32 leaves (as the Trainer's; the libraries that want bf16 get ``.bfloat16()``
casts, as a user passes them), peak ``torch.cuda.max_memory_allocated`` above the inputs, time per
forward and backward after ``--warmup`` untimed ones. On the CPU: fp32, the peak resident set
above the one after the inputs were built (``ru_maxrss``), time likewise. Host syncs: one more
call under `syncs.HostSyncs`. Errors: of the last timed call's loss and gradients against the
unfused head in fp32 (on CUDA without TF32), computed after the timing: the loss's relative error,
and per gradient the largest entry's error over the largest entry (``max err``). A variant that
cannot run here is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
import torch.nn.functional as F

from .syncs import HostSyncs
from .throughput import Skipped, cut_cross_entropy, in_fresh_process, needs_gpu, torch_linear_cross_entropy

VARIANTS = ("unfused", "unfused_compiled", "fused", "fused_compiled", "liger", "cce", "cce_exact", "torch_lce")


def _inputs(args, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=g)).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    return x, weight, target


def _unfused(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")


def _loss_fn(variant: str, device: torch.device):
    """``loss(x, weight, target)``, the summed loss of the head ``x W^T`` against ``target``."""
    if variant == "unfused":
        return _unfused
    if variant == "unfused_compiled":  # what a whole-model compile makes of the head and loss
        return torch.compile(_unfused)
    if variant.startswith("fused"):
        from ..tp.cross_entropy import EAGER, ChunkKernels
        from ..tp.fused_cross_entropy import fused_linear_cross_entropy

        kernels = ChunkKernels("inductor") if variant == "fused_compiled" else EAGER
        return lambda x, w, t: fused_linear_cross_entropy([x], [w], t, [0], lambda parts: parts, kernels=kernels)
    if variant == "liger":
        needs_gpu("liger-kernel", device)
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as e:
            raise Skipped(f"liger-kernel is not installed (pip install liger-kernel): {e}") from None
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        return lambda x, w, t: liger(w, x, t)
    if variant in ("cce", "cce_exact"):
        cce = cut_cross_entropy(device)
        exact = {"filter_eps": None} if variant == "cce_exact" else {}  # the default skips small gradient entries
        return lambda x, w, t: cce(x.bfloat16(), w.bfloat16(), t, reduction="sum", **exact)
    if variant == "torch_lce":
        lce = torch_linear_cross_entropy()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # autocast's, as the head's matmul
        return lambda x, w, t: lce(x.to(dtype), w.to(dtype), t, reduction="sum")
    raise ValueError(f"variant {variant!r}: use one of {VARIANTS}")


def _reference(x, weight, target):
    """The unfused head's loss and gradients in fp32 (no autocast, no TF32)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        xr, wr = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = _unfused(xr, wr, target)
        loss.backward()
        return loss.item(), xr.grad, wr.grad
    finally:
        torch.set_float32_matmul_precision(precision)


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def measure(variant: str, args) -> dict:
    device = torch.device(args.device)
    try:
        loss_fn = _loss_fn(variant, device)
    except Skipped as why:
        return {"variant": variant, "skipped": str(why)}
    x, weight, target = _inputs(args, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        x.grad = weight.grad = None
        with autocast:
            loss = loss_fn(x, weight, target)
        loss.backward()
        return loss

    resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak so far: the inputs
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else resident
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    loss, grad_x, grad_w = loss.item(), x.grad, weight.grad
    with HostSyncs(device) as syncs:
        step()
    sync()
    ref_loss, ref_x, ref_w = _reference(x, weight, target)
    return {"variant": variant, "ms": 1e3 * seconds, "peak_above_inputs_mib": (peak - base) / 2**20,
            "host_syncs": syncs.count, "loss": loss, "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
            "grad_x_max_err": _max_err(grad_x, ref_x), "grad_w_max_err": _max_err(grad_w, ref_w)}


def table(rows: list[dict], args) -> str:
    lines = [f"head {args.vocab} x {args.hidden}, {args.tokens} tokens, {args.device}, {args.steps} timed calls", "",
             "| variant | ms (forward + backward) | peak MiB above the inputs | host syncs | loss | loss rel err "
             "| grad x max err | grad W max err |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"failed: {' / '.join(r['error'])}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['variant']} | {why} | | | | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r['peak_above_inputs_mib']:.0f} | {r['host_syncs']} | "
                         f"{r['loss']:.1f} | {r['loss_rel_err']:.1e} | {r['grad_x_max_err']:.1e} | "
                         f"{r['grad_w_max_err']:.1e} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args)), flush=True)
        return []
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: use {', '.join(VARIANTS)}")
    rows = []
    for variant in variants:
        rows.append(in_fresh_process("taco_accel.bench.fused_loss", "variant", variant, argv))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows, args))
    return rows


if __name__ == "__main__":
    main()
