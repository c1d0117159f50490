"""Time and profile one training step of the convergence study's emulated-TP model.

    python scripts/profile_emulated_step.py --preset h200-100m --variants none taco

For each variant: the study's own step (`VariantRun`, the pretraining `Trainer`'s step on
emulated TP) timed over a few steps after a warm-up, then one step under the profiler: kernel
launches and device time per step, and the operations that take the most of it (GPU kernels on
CUDA, CPU operators otherwise). The data is the study's (`load_data`, cached in ``--out``'s
``cache/`` as ``python -m taco_accel.bench.convergence --prepare`` leaves it). Prints a table per
variant and a summary line each last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from taco_accel.bench.convergence import PRESETS, VARIANTS, VariantRun, load_data

WARMUP_STEPS, TIMED_STEPS = 2, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_variant(key: str, preset, data, device: torch.device, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    run = VariantRun(key, data, preset, seed=0, group_size=128, device=device)
    for _ in range(WARMUP_STEPS):
        run.train_step()
    times = []
    for _ in range(TIMED_STEPS):
        _sync(device)
        t0 = time.perf_counter()
        run.train_step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run.train_step()
        _sync(device)
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    ops = [e for e in prof.events() if e.device_type == wanted and (cuda or e.cpu_parent is None)]
    total_us = sum(e.device_time_total if cuda else e.cpu_time_total for e in ops)
    by_name: dict[str, list[float]] = {}
    for e in ops:
        by_name.setdefault(e.name, []).append(e.device_time_total if cuda else e.cpu_time_total)
    print(f"\n{key}: top {top} {'kernels' if cuda else 'top-level CPU operators'} of one step by time")
    print(f"{'ms':>8s} {'share':>6s} {'calls':>6s}  name")
    for name, values in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(values) / 1e3:8.2f} {sum(values) / total_us:6.1%} {len(values):6d}  {name[:100]}")
    return dict(key=key, step_s=statistics.median(times), ops=len(ops), device_s=total_us / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="h200-100m", choices=sorted(PRESETS))
    parser.add_argument("--variants", nargs="+", default=["none", "taco"], choices=list(VARIANTS))
    parser.add_argument("--data", nargs="+", help="text sources for load_texts (default: the preset's)")
    parser.add_argument("--out", default="runs/convergence", help="the study's folder (its cache/ is used)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    preset, device = PRESETS[args.preset], torch.device(args.device)
    if args.data:
        from dataclasses import replace

        preset = replace(preset, data=tuple(args.data))
    data = load_data(preset, Path(args.out) / "cache")
    rows = [profile_variant(key, preset, data, device, args.top) for key in args.variants]
    print(f"\n{args.preset}, emulated tp={preset.tp}, {preset.batch}x{preset.seq_len} tokens per step, {device}")
    print(f"{'variant':>8s} {'step s':>8s} {'ops':>8s} {'busy s':>7s}")
    for r in rows:
        print(f"{r['key']:>8s} {r['step_s']:8.3f} {r['ops']:8d} {r['device_s']:7.3f}")


if __name__ == "__main__":
    main()
