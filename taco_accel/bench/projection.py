"""A small cost model of TP training with and without TACO, and its check against gloo runs.

    python -m taco_accel.bench.projection --preset qwen-7b --tp 8 --link-gbs 450
    python -m taco_accel.bench.projection --validate-gloo       # measured vs predicted, CPU

Model (Megatron TP without sequence parallelism; TP communication is on the critical path):

* per step and micro-batch of b*s tokens, a transformer of L layers does 4 all-reduces of
  n = b*s*h values per layer (forward: attention and MLP outputs; backward: the input
  gradients of the q/k/v and gate/up projections) plus 2 for the embedding and the head;
* plain ring all-reduce of n bf16 values on P ranks: ``2(P-1)/P * 2n / B + 2(P-1) * lat``;
* TACO two-shot: the wire carries ``w = n * (1 + 4k/G)`` bytes (k scales per group), so
  ``2(P-1)/P * w / B`` on the link, plus the codec: compress (2n + w bytes over its
  throughput), dequant-sum-requant ((P+1) w/P bytes) and decompress (w + 2n bytes). Large
  messages are split into pieces that overlap codec and wire, so the time lies between
  ``max(codec, wire)`` (perfect overlap) and ``codec + wire`` (none); both are printed;
* compute: ``(6 N + 12 L h s) * b * s / P`` FLOPs at the achieved rate F per GPU.

The codec throughputs default to the H200 measurements of benchmarks/RESULTS.md (fractions
of the measured copy bandwidth); pass ``--codec-gbs`` to use others.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

PRESETS = {  # hidden, layers, parameters (billions)
    "qwen-0.5b": (896, 24, 0.49),
    "qwen-1.5b": (1536, 28, 1.54),
    "qwen-7b": (3584, 28, 7.6),
    "llama-13b": (5120, 40, 13.0),
    "gpt2-xl": (1600, 48, 1.56),
}


@dataclass
class Link:
    bus_gbs: float  # per-GPU bus bandwidth of the collective, GB/s
    latency_us: float = 5.0


@dataclass
class Codec:
    compress_gbs: float
    sum_gbs: float
    decompress_gbs: float
    group_size: int = 128
    num_scales: int = 1

    @property
    def wire_ratio(self) -> float:
        """Wire bytes per input element."""
        return 1 + 4 * self.num_scales / self.group_size


def plain_all_reduce_s(n: int, p: int, link: Link, elem_bytes: int = 2) -> float:
    return 2 * (p - 1) / p * n * elem_bytes / (link.bus_gbs * 1e9) + 2 * (p - 1) * link.latency_us * 1e-6


def taco_all_reduce_s(n: int, p: int, link: Link, codec: Codec, elem_bytes: int = 2) -> tuple[float, float]:
    """(perfect overlap, no overlap) seconds of one compressed two-shot all-reduce."""
    w = n * codec.wire_ratio
    wire = 2 * (p - 1) / p * w / (link.bus_gbs * 1e9) + 2 * (p - 1) * link.latency_us * 1e-6
    codec_s = (
        (elem_bytes * n + w) / (codec.compress_gbs * 1e9)
        + (p + 1) * w / p / (codec.sum_gbs * 1e9)
        + (w + elem_bytes * n) / (codec.decompress_gbs * 1e9)
    )
    return max(codec_s, wire), codec_s + wire


def project(hidden: int, layers: int, params_b: float, tp: int, tokens: int, seq: int, tflops: float,
            link: Link, codec: Codec, threshold_bytes: int = 8 * 2**20) -> dict:
    """Step times and the speedup of TACO over plain bf16 TP for one micro-batch of ``tokens``."""
    n = tokens * hidden
    count = 4 * layers + 2
    compute = (6 * params_b * 1e9 + 12 * layers * hidden * seq) * tokens / tp / (tflops * 1e12)
    plain = count * plain_all_reduce_s(n, tp, link)
    if 2 * n < threshold_bytes:
        best = worst = plain
    else:
        overlap, serial = taco_all_reduce_s(n, tp, link, codec)
        best, worst = count * overlap, count * serial
    return dict(
        compute_s=compute, comm_plain_s=plain, comm_taco_best_s=best, comm_taco_worst_s=worst,
        speedup_best=(compute + plain) / (compute + best), speedup_worst=(compute + plain) / (compute + worst),
        message_mib=2 * n / 2**20,
    )


def h200_codec(copy_gbs: float = 4244.0, fractions=(0.90, 0.91, 0.83)) -> Codec:
    """Codec throughputs as fractions of the copy bandwidth: compress, sum (P=4), decompress,
    measured on an H200 at 256M elements, G=128 (benchmarks/RESULTS.md)."""
    return Codec(*(f * copy_gbs for f in fractions))


def print_projection(args) -> None:
    hidden, layers, params = PRESETS[args.preset]
    codec = Codec(*args.codec_gbs) if args.codec_gbs else h200_codec(args.copy_gbs)
    print(f"{args.preset}: hidden {hidden}, {layers} layers, {params}B params, tp {args.tp}, "
          f"{args.tokens} tokens/micro-batch (seq {args.seq}), {args.tflops} TFLOP/s per GPU achieved")
    print(f"codec GB/s: compress {codec.compress_gbs:.0f}, sum {codec.sum_gbs:.0f}, decompress {codec.decompress_gbs:.0f}")
    print(f"{'link GB/s':>9s} {'msg MiB':>8s} {'compute ms':>10s} {'plain comm':>10s} {'taco comm':>15s} {'speedup':>13s}")
    for bw in args.link_gbs:
        r = project(hidden, layers, params, args.tp, args.tokens, args.seq, args.tflops, Link(bw), codec)
        print(f"{bw:9.0f} {r['message_mib']:8.1f} {r['compute_s'] * 1e3:10.1f} {r['comm_plain_s'] * 1e3:10.1f} "
              f"{r['comm_taco_best_s'] * 1e3:6.1f}..{r['comm_taco_worst_s'] * 1e3:6.1f}  "
              f"{r['speedup_worst']:5.2f}..{r['speedup_best']:5.2f}x")


# --- validation on gloo (CPU) ------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, init_file: str, numel: int, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from ..codec import TacoConfig, compress, decompress, sum_packed
    from ..comm import all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x = torch.randn(numel) * 0.02
    cfg = TacoConfig(threshold_bytes=0, piece_bytes=0)

    def clock(fn):
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    plain = clock(lambda: dist.all_reduce(x.clone()))
    taco = clock(lambda: all_reduce(x, config=cfg))
    # the codec stages alone, on this rank's share, as the cost model counts them
    packed = compress(x, cfg, chunks=world)
    chunk = packed.layout.chunk_layout()
    stacked = packed.buffer.view(world, -1)
    t_c = clock(lambda: compress(x, cfg, chunks=world))
    t_s = clock(lambda: sum_packed(stacked, chunk, cfg))
    t_d = clock(lambda: decompress(packed))
    if rank == 0:
        queue.put(dict(plain=plain, taco=taco, compress=t_c, sum=t_s, decompress=t_d, wire=packed.nbytes))
    dist.destroy_process_group()


def validate_gloo(world: int = 2, sizes=(2**20, 2**22, 2**24), reps: int = 5) -> None:
    """Measure plain and compressed gloo all-reduce and compare with the model's prediction."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    print(f"gloo, {world} ranks on this CPU: measured vs predicted compressed all-reduce (fp32 input)")
    print(f"{'elements':>9s} {'plain ms':>9s} {'link GB/s':>9s} {'taco ms':>8s} {'predicted ms':>16s}")
    ctx = mp.get_context("spawn")
    for numel in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_gloo_worker, args=(r, world, os.path.join(tmp, "s"), numel, reps, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            m = queue.get(timeout=600)
            for p in procs:
                p.join()
        # the link bandwidth the plain collective achieved defines B for this machine
        link = Link(bus_gbs=2 * (world - 1) / world * numel * 4 / m["plain"] / 1e9, latency_us=0.0)
        w = m["wire"]
        codec = Codec(
            compress_gbs=(4 * numel + w) / m["compress"] / 1e9,
            sum_gbs=(world + 1) * w / world / m["sum"] / 1e9,
            decompress_gbs=(w + 4 * numel) / m["decompress"] / 1e9,
        )
        best, worst = taco_all_reduce_s(numel, world, link, codec, elem_bytes=4)
        print(f"{numel / 2**20:8.1f}M {m['plain'] * 1e3:9.2f} {link.bus_gbs:9.2f} {m['taco'] * 1e3:8.2f} "
              f"{best * 1e3:7.2f}..{worst * 1e3:7.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen-7b", choices=sorted(PRESETS))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (b*s)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tflops", type=float, default=400.0, help="achieved dense TFLOP/s per GPU")
    parser.add_argument("--link-gbs", type=float, nargs="+", default=[450.0, 150.0, 50.0, 25.0])
    parser.add_argument("--copy-gbs", type=float, default=4244.0)
    parser.add_argument("--codec-gbs", type=float, nargs=3, metavar=("COMPRESS", "SUM", "DECOMPRESS"))
    parser.add_argument("--validate-gloo", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if args.validate_gloo:
        validate_gloo(args.world_size)
    else:
        print_projection(args)


if __name__ == "__main__":
    main()
