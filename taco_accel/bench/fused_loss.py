"""The lm head and its loss, forward and backward, at a real vocabulary: peak memory and time of the
unfused head (the logits, then the cross-entropy), ours fused (`tp.fused_cross_entropy`, eager and
with its chunk arithmetic compiled) and liger-kernel's fused linear cross-entropy where installed.

    python -m taco_accel.bench.fused_loss                                # GPU: Qwen2.5-0.5B's head, 4 x 1024 tokens, bf16
    python -m taco_accel.bench.fused_loss --device cpu --tokens 1024     # CPU: fp32, peak resident memory

Each variant runs in a process of its own. On CUDA: bf16 autocast over fp32 weights (as the
Trainer's), peak ``torch.cuda.max_memory_allocated`` above the inputs, time per forward and
backward after ``--warmup`` untimed ones. On the CPU: fp32, the peak resident set above the one
after the inputs were built (``ru_maxrss``), time likewise.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
import torch.nn.functional as F

from .throughput import in_fresh_process

VARIANTS = ("unfused", "fused", "fused_compiled", "liger")


def _inputs(args, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=g)).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    return x, weight, target


def _loss_fn(variant: str, device: torch.device):
    """``loss(x, weight, target)``, the summed next-token loss of the head ``x W^T``."""
    if variant == "unfused":
        return lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")
    if variant.startswith("fused"):
        from ..tp.fused_cross_entropy import EAGER, ChunkKernels, fused_linear_cross_entropy

        kernels = ChunkKernels("inductor") if variant == "fused_compiled" else EAGER
        return lambda x, w, t: fused_linear_cross_entropy([x], [w], t, [0], lambda parts: parts, kernels=kernels)
    if variant == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as e:
            raise SystemExit(f"skipped: liger-kernel is not installed ({e})") from None
        if device.type != "cuda":
            raise SystemExit("skipped: liger-kernel's kernels are Triton kernels for GPUs")
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        return lambda x, w, t: liger(w, x, t)
    raise ValueError(f"variant {variant!r}: use one of {VARIANTS}")


def measure(variant: str, args) -> dict:
    device = torch.device(args.device)
    x, weight, target = _inputs(args, device)
    loss_fn = _loss_fn(variant, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with autocast:
            loss = loss_fn(x, weight, target)
        loss.backward()
        x.grad = weight.grad = None
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
    return {"variant": variant, "ms": 1e3 * seconds, "peak_above_inputs_mib": (peak - base) / 2**20,
            "loss": loss.item()}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args)), flush=True)
        return []
    rows = []
    for variant in args.variants.split(","):
        rows.append(in_fresh_process("taco_accel.bench.fused_loss", "variant", variant,
                                     list(argv if argv is not None else sys.argv[1:])))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nhead {args.vocab} x {args.hidden}, {args.tokens} tokens, {args.device}\n")
    print("| variant | ms (forward + backward) | peak MiB above the inputs | loss |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {' '.join(r['error'])} | | |")
        else:
            print(f"| {r['variant']} | {r['ms']:.1f} | {r['peak_above_inputs_mib']:.0f} | {r['loss']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
