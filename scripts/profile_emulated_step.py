"""Time and profile one training step of the convergence study's emulated-TP model.

    python scripts/profile_emulated_step.py --preset h200-100m --variants none taco

For each variant: the eager step, the step replayed from a CUDA graph (`TrainStep`, as the
study runs it), and one eager step under the profiler: kernel launches and GPU time per step,
and the kernels that take the most of it. Random token ids (no data preparation): the shapes,
not the values, set the time. Prints a table per variant and a summary line each last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from taco_accel.bench.convergence import PRESETS, VARIANTS, Data, TrainStep, build_model, make_optimizer


def profile_variant(key: str, preset, data: Data, device: torch.device, replays: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = build_model(data, VARIANTS[key], preset, seed=0, group_size=128, device=device)
    opt = make_optimizer(model, preset, device, capturable=True)
    gen = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(0, data.config.vocab_size, (preset.batch, preset.seq_len + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    eager = TrainStep(model, opt, device, preset.bf16, graph=False)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eager(*batch(), lr=preset.lr)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager(*batch(), lr=preset.lr)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time_total for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time_total)
    graphed = TrainStep(model, opt, device, preset.bf16, graph=True)
    for _ in range(TrainStep.EAGER_STEPS + 1):
        graphed(*batch(), lr=preset.lr)
    inputs = [batch() for _ in range(replays)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, y in inputs:
        graphed(x, y, lr=preset.lr)
    end.record()
    torch.cuda.synchronize()
    print(f"\n{key}: top {top} kernels of one eager step by GPU time")
    print(f"{'GPU ms':>8s} {'share':>6s} {'calls':>6s}  kernel")
    for name, values in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(values) / 1e3:8.2f} {sum(values) / gpu_us:6.1%} {len(values):6d}  {name[:100]}")
    return dict(key=key, eager_s=statistics.median(times[1:]), graph_s=start.elapsed_time(end) / 1e3 / replays,
                kernels=len(kernels), gpu_s=gpu_us / 1e6, graphed=graphed.graphed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="h200-100m", choices=sorted(PRESETS))
    parser.add_argument("--variants", nargs="+", default=["none", "taco"], choices=list(VARIANTS))
    parser.add_argument("--vocab", type=int, default=16384, help="the study's BPE vocabulary")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    from transformers import Qwen2Config

    preset, device = PRESETS[args.preset], torch.device("cuda")
    config = Qwen2Config(vocab_size=args.vocab, max_position_embeddings=max(preset.seq_len, 128), **preset.model)
    data = Data(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), config)
    rows = [profile_variant(key, preset, data, device, args.replays, args.top) for key in args.variants]
    print(f"\n{args.preset}, emulated tp={preset.tp}, {preset.batch}x{preset.seq_len} tokens per step")
    print(f"{'variant':>8s} {'eager s':>8s} {'graph s':>8s} {'kernels':>8s} {'GPU s':>7s}")
    for r in rows:
        print(f"{r['key']:>8s} {r['eager_s']:8.3f} {r['graph_s']:8.3f} {r['kernels']:8d} {r['gpu_s']:7.3f}"
              + ("" if r["graphed"] else "  (capture failed: eager)"))


if __name__ == "__main__":
    main()
