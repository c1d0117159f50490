"""A cost model of TP training with and without TACO, per topology, and its check against gloo runs;
and of a whole 3D step's traffic (TP, pipeline boundaries, data-parallel gradients) per cluster.

    python -m taco_accel.bench.projection                                  # 7B, tp 8, every topology
    python -m taco_accel.bench.projection --preset llama-13b --topologies pcie multinode
    python -m taco_accel.bench.projection --pieces                         # piece size vs time
    python -m taco_accel.bench.projection --validate-gloo                  # measured vs predicted, CPU
    python -m taco_accel.bench.projection --traffic --pp 2 --dp 4          # tp / pp / dp per cluster

Model (Megatron TP without sequence parallelism, one micro-batch of ``tokens`` tokens):

* collectives: per layer 2 forward all-reduces (attention and MLP outputs) and 2 backward ones
  (the input gradients of the q/k/v and gate/up regions), plus the embedding's (forward) and
  the lm head's (backward); each of n = tokens * hidden values in bf16;
* plain all-reduce: ``latency + f * 2n / B`` with B the per-GPU bus bandwidth of the link and
  ``f = 2(P-1)/P`` for NCCL's ring, ``0.76 * 2(P-1)/P`` for NVLS (NVSwitch reduces in the
  switch: NCCL's default for large bf16 all-reduces on NVSwitch machines; 0.76 is the ratio
  that puts the compressed two-shot's ceiling at about 1.475x against NVLS where against the
  ring it is the byte ratio, 1.94x).
  The compressed two-shot cannot use NVLS (scales differ per rank);
* compressed all-reduce: `simulate_all_reduce` replays the schedule of
  ``comm.pieces.Pipeline`` (pieces of ``piece_bytes``; per piece compress, all-to-all, sum,
  all-gather, decompress) on two in-order streams (kernels, NCCL) and the host that issues
  them (``host_us`` per operation), with the H200 stage costs of benchmarks/RESULTS.md:
  a fixed cost per kernel (compress 3.7 us, decompress 1.7 us, sum 5 us: the intercept of
  time against size) plus bytes over the measured throughputs (fractions of the 4244 GB/s
  copy bandwidth); each collective pays ``latency`` plus its bytes over B;
* overlap with compute (``overlap=True``, what `taco_accel.tp.overlap` does): the backward
  all-reduce of a column region runs while the region's weight-gradient matmuls run
  (2 * tokens * hidden * (q+k+v or gate+up outputs) / P FLOPs); a plain all-reduce is then
  exposed for ``max(0, t - t_wgrad)``; a compressed one for ``max(t_codec, t - t_wgrad)``,
  as its kernels compete with the matmul for the GPU;
* auto (the default mode): each collective compressed only where its compressed time beats
  the plain one by 5% (what `comm.autotune` measures);
* compute: ``(6 N + 12 L h s) * tokens / P`` FLOPs at the achieved rate F per GPU.

NCCL latencies and the host time per operation are assumptions (no multi-GPU machine was
available), not measurements: pass ``--latency-us`` / ``--host-us`` to test others.

``--traffic`` (`project_traffic`): one optimizer step of a tp x pp x dp job (``micro_batches``
micro-batches of ``tokens`` tokens per replica, 1F1B), per kind of traffic, on clusters
(`CLUSTERS`) whose tp groups sit inside a node and whose pipeline and dp neighbours are
across nodes:

* tp: the collectives above, for the ``layers / pp`` layers of a stage, per micro-batch;
* pp: per micro-batch and stage boundary an activation forward and its gradient backward, each
  ``tokens * hidden`` bf16 values per rank (no scatter-gather over tp), a p2p send of
  ``latency + bytes / B`` on the critical path; compressed: the codec's bytes plus its encode
  (sender) and decode (receiver);
* dp: after the last backward, each replica's gradient of ``params / (tp * pp)`` values
  (``--grad-bytes``: 4 for fp32 gradients as in the recipes, 2 for bf16) averaged over dp: a ring
  all-reduce of ``2 (D-1)/D`` of its bytes, one latency per 64 MiB bucket; compressed
  (`taco_accel.parallel.data_parallel`): the same fraction of the codec's bytes, plus its
  kernels (encode, decode of the received chunks, encode of the averaged shard, decode of the
  whole, at the codec's throughputs) and the residuals' fp32 traffic at the copy bandwidth,
  none of it overlapped with compute;
* step: ``(micro_batches + pp - 1)`` times a micro-batch's stage time (compute, exposed tp, pp
  sends), plus the dp reduction; each kind compressed where it pays by 5% (auto).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from ..comm.pieces import PIECE_BYTES

MiB = 2**20
NVLS_FACTOR = 0.76  # NVLS all-reduce bytes / ring bytes: the two-shot's ceiling 1.475x against NVLS, 1.94x against ring
AUTO_MARGIN = 0.05  # comm.autotune.MARGIN


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    params_b: float
    intermediate: int
    kv_dim: int  # key (= value) projection width
    vocab: int


PRESETS = {
    "qwen-0.5b": Preset(896, 24, 0.49, 4864, 128, 151936),
    "qwen-1.5b": Preset(1536, 28, 1.54, 8960, 256, 151936),
    "qwen-7b": Preset(3584, 28, 7.6, 18944, 512, 152064),
    "llama-13b": Preset(5120, 40, 13.0, 13824, 5120, 32000),
    "gpt2-xl": Preset(1600, 48, 1.56, 6400, 1600, 50257),
}


@dataclass(frozen=True)
class Link:
    """A TP group's interconnect as one collective sees it."""

    name: str
    bus_gbs: float  # per-GPU bus bandwidth of a collective, GB/s
    latency_us: float = 10.0  # per collective call
    algo: str = "ring"  # NCCL's algorithm for the plain all-reduce: "ring" or "nvls"


TOPOLOGIES = {
    "nvswitch": Link("8x H200 NVSwitch, NCCL NVLS", 450.0, 10.0, "nvls"),
    "nvswitch-ring": Link("8x H200 NVSwitch, NCCL ring (NCCL_NVLS_ENABLE=0)", 450.0, 10.0, "ring"),
    "pcie": Link("PCIe Gen5 box, no NVLink (NCCL_P2P_DISABLE=1)", 25.0, 15.0, "ring"),
    "multinode": Link("TP across 2 nodes, 400 Gb/s InfiniBand per GPU", 50.0, 25.0, "ring"),
}
ETHERNET_100G = Link("100 Gb/s Ethernet (RoCE) per GPU", 12.5, 30.0, "ring")
# clusters of 8-GPU nodes: the link of each kind of traffic (tp inside a node; pp and dp across nodes)
CLUSTERS = {
    "ib-400g": {"tp": TOPOLOGIES["nvswitch"], "pp": TOPOLOGIES["multinode"], "dp": TOPOLOGIES["multinode"]},
    "eth-100g": {"tp": TOPOLOGIES["nvswitch"], "pp": ETHERNET_100G, "dp": ETHERNET_100G},
    "pcie-ib": {"tp": TOPOLOGIES["pcie"], "pp": TOPOLOGIES["multinode"], "dp": TOPOLOGIES["multinode"]},
}
BUCKET_BYTES = 64 * MiB  # parallel.data_parallel.DataParallelGradSync's


@dataclass(frozen=True)
class Codec:
    """Codec throughputs (GB/s of bytes read + written) and fixed costs per kernel (us)."""

    compress_gbs: float
    sum_gbs: float
    decompress_gbs: float
    group_size: int = 128
    num_scales: int = 1
    compress_us: float = 3.7
    sum_us: float = 5.0
    decompress_us: float = 1.7

    @property
    def wire_ratio(self) -> float:
        """Wire bytes per input element."""
        return 1 + 4 * self.num_scales / self.group_size


def h200_codec(copy_gbs: float = 4244.0, fractions=(1.0, 0.95, 0.97)) -> Codec:
    """H200, G = 128: the bandwidth slopes (fractions of the copy bandwidth: compress 1.03,
    decompress 0.96 in the twelfth run's time-against-size fit; sum of 8 0.96-1.00 from 64M on)
    and the fixed costs of that fit (sum: 5.7 us from its 16M / 64M times)."""
    return Codec(*(f * copy_gbs for f in fractions))


# --- one collective ---------------------------------------------------------------------------


def plain_all_reduce_s(n: int, p: int, link: Link, elem_bytes: int = 2) -> float:
    factor = 2 * (p - 1) / p * (NVLS_FACTOR if link.algo == "nvls" else 1.0)
    return link.latency_us * 1e-6 + factor * n * elem_bytes / (link.bus_gbs * 1e9)


def _stages(m: int, p: int, link: Link, codec: Codec, elem_bytes: int) -> list[tuple[str, float]]:
    """(stream, seconds) of the 5 operations of one piece of m values, in dependency order."""
    w = m * codec.wire_ratio
    wire = link.latency_us * 1e-6 + (p - 1) / p * w / (link.bus_gbs * 1e9)
    return [
        ("gpu", codec.compress_us * 1e-6 + (elem_bytes * m + w) / (codec.compress_gbs * 1e9)),
        ("net", wire),  # all-to-all
        ("gpu", codec.sum_us * 1e-6 + (p + 1) * w / p / (codec.sum_gbs * 1e9)),
        ("net", wire),  # all-gather of the reduced chunks
        ("gpu", codec.decompress_us * 1e-6 + (w + elem_bytes * m) / (codec.decompress_gbs * 1e9)),
    ]


def simulate_all_reduce(n: int, p: int, link: Link, codec: Codec, piece_bytes: int = 0,
                        host_us: float = 15.0, elem_bytes: int = 2) -> dict:
    """Seconds of one compressed all-reduce of n values: ``total`` and ``codec`` (kernel time).

    The issue order is `comm.pieces.Pipeline`'s: each tick starts a piece and advances the
    live ones newest first (piece t: compress, all-to-all; t-1: sum, all-gather; t-2:
    decompress); each operation starts when its stream is free, its predecessor in the piece
    is done and the host has issued it."""
    step = n if piece_bytes <= 0 else max(1, min(n, piece_bytes // elem_bytes))
    sizes = [min(step, n - a) for a in range(0, n, step)]
    plan = [_stages(m, p, link, codec, elem_bytes) for m in sizes]
    done = [[None] * 5 for _ in sizes]
    free = {"gpu": 0.0, "net": 0.0}
    host = 0.0
    ticks = len(sizes) + 2
    for tick in range(ticks):
        for piece in range(min(tick, len(sizes) - 1), max(-1, tick - 3), -1):  # newest first
            phase = tick - piece  # 0: ops 0-1, 1: ops 2-3, 2: op 4
            for op in ((0, 1), (2, 3), (4,))[phase]:
                stream, seconds = plan[piece][op]
                host += host_us * 1e-6
                ready = done[piece][op - 1] if op else 0.0
                start = max(free[stream], ready, host)
                done[piece][op] = free[stream] = start + seconds
    return {"total": max(max(d) for d in done), "codec": sum(s for stages in plan for st, s in stages if st == "gpu")}


# --- one training step ------------------------------------------------------------------------


def project(preset: Preset, tp: int, tokens: int, seq: int, tflops: float, link: Link, codec: Codec,
            piece_bytes: int = PIECE_BYTES, host_us: float = 15.0, overlap: bool = True) -> dict:
    """Step times (s) of one micro-batch: plain bf16 TP and TACO in auto mode."""
    h, layers = preset.hidden, preset.layers
    n = tokens * h
    flops = tflops * 1e12
    compute = (6 * preset.params_b * 1e9 + 12 * layers * h * seq) * tokens / tp / flops
    plain = plain_all_reduce_s(n, tp, link)
    taco = simulate_all_reduce(n, tp, link, codec, piece_bytes, host_us)
    use_taco = taco["total"] < plain * (1 - AUTO_MARGIN)
    # (count, weight-gradient seconds that can hide it)
    wgrad = lambda outputs: 2 * tokens * h * outputs / tp / flops  # noqa: E731
    groups = [(2 * layers + 1, 0.0),  # forward: attention / MLP outputs, embedding
              (layers, wgrad(h + 2 * preset.kv_dim) if overlap else 0.0),  # backward: q/k/v input grads
              (layers, wgrad(2 * preset.intermediate) if overlap else 0.0),  # backward: gate/up input grads
              (1, wgrad(preset.vocab) if overlap else 0.0)]  # backward: lm head input grad
    exposed_plain = sum(c * max(0.0, plain - hide) for c, hide in groups)
    exposed_on = sum(c * max(taco["codec"], taco["total"] - hide) for c, hide in groups)
    exposed_auto = exposed_on if use_taco else exposed_plain
    return dict(
        compute_s=compute, message_mib=2 * n / MiB, plain_ar_s=plain, taco_ar_s=taco["total"],
        taco_codec_s=taco["codec"], auto_compresses=use_taco,
        step_plain_s=compute + exposed_plain, step_auto_s=compute + exposed_auto,
        speedup=(compute + exposed_plain) / (compute + exposed_auto),
        speedup_on=(compute + exposed_plain) / (compute + exposed_on),
        comm_plain_s=exposed_plain, comm_auto_s=exposed_auto,
    )


# --- one 3D step: tp, pp and dp traffic ---------------------------------------------------------


def p2p_s(n: int, link: Link, codec: Codec | None = None, elem_bytes: int = 2) -> float:
    """One send of n values over ``link``: plain, or (``codec``) encoded, sent, decoded."""
    if codec is None:
        return link.latency_us * 1e-6 + n * elem_bytes / (link.bus_gbs * 1e9)
    w = n * codec.wire_ratio
    return (codec.compress_us * 1e-6 + (elem_bytes * n + w) / (codec.compress_gbs * 1e9)
            + link.latency_us * 1e-6 + w / (link.bus_gbs * 1e9)
            + codec.decompress_us * 1e-6 + (w + elem_bytes * n) / (codec.decompress_gbs * 1e9))


def dp_reduce_s(n: int, d: int, link: Link, codec: Codec | None = None, grad_bytes: int = 4,
                copy_gbs: float = 4244.0) -> float:
    """The dp average of n gradient values over d replicas: a ring all-reduce, or (``codec``) the
    compressed reduce-scatter + all-gather with error feedback."""
    if d == 1:
        return 0.0
    buckets = max(1, -(-n * grad_bytes // BUCKET_BYTES))
    per_elem = grad_bytes if codec is None else codec.wire_ratio
    t = buckets * link.latency_us * 1e-6 * (1 if codec is None else 2) + 2 * (d - 1) / d * n * per_elem / (
        link.bus_gbs * 1e9)
    if codec is None:
        return t
    w = codec.wire_ratio
    kernels = (n * (4 + w) * (1 + 1 / d) / (codec.compress_gbs * 1e9)  # encode the gradient, then the shard
               + n * (w + 4) * (2 + 2 / d) / (codec.decompress_gbs * 1e9)  # residuals' decodes, the chunks, the whole
               + n * 16 * (1 + 1 / d) / (copy_gbs * 1e9))  # fp32 residual reads and writes, the fp32 sum
    return t + kernels


def project_traffic(preset: Preset, tp: int, pp: int, dp: int, micro_batches: int, tokens: int, seq: int,
                    tflops: float, links: dict[str, Link], codec: Codec, *, grad_bytes: int = 4,
                    piece_bytes: int = PIECE_BYTES, host_us: float = 15.0, overlap: bool = True) -> dict:
    """One optimizer step of a tp x pp x dp job (see the module doc): per kind (``tp``, ``pp``,
    ``dp``) the bytes one GPU sends per step plain and compressed, the time that traffic adds
    to the step plain and in auto mode; and the step times."""
    h = preset.hidden
    n = tokens * h
    stage_tp = project(replace(preset, layers=max(1, preset.layers // pp)), tp, tokens, seq, tflops, links["tp"],
                       codec, piece_bytes, host_us, overlap)
    compute_mb = (6 * preset.params_b * 1e9 + 12 * preset.layers * h * seq) * tokens / (tp * pp) / (tflops * 1e12)
    ar_bytes = 2 * (tp - 1) / tp * n  # per tp all-reduce and value, times the element size
    tp_calls = 4 * max(1, preset.layers // pp) + 2  # 2 fwd + 2 bwd per layer, embedding and head
    kinds = {
        "tp": dict(link=links["tp"], plain_b=micro_batches * tp_calls * ar_bytes * 2,
                   taco_b=micro_batches * tp_calls * ar_bytes * codec.wire_ratio,
                   plain_s=micro_batches * stage_tp["comm_plain_s"],
                   auto_s=micro_batches * stage_tp["comm_auto_s"]),
    }
    sends = 2 * micro_batches if pp > 1 else 0  # per boundary: activation forward, gradient backward
    pp_plain, pp_taco = p2p_s(n, links["pp"]), p2p_s(n, links["pp"], codec)
    kinds["pp"] = dict(link=links["pp"], plain_b=sends * n * 2, taco_b=sends * n * codec.wire_ratio,
                       plain_s=sends * pp_plain,
                       auto_s=sends * (pp_taco if pp_taco < pp_plain * (1 - AUTO_MARGIN) else pp_plain))
    local = int(preset.params_b * 1e9 / (tp * pp))
    dp_plain = dp_reduce_s(local, dp, links["dp"], None, grad_bytes)
    dp_taco = dp_reduce_s(local, dp, links["dp"], codec)
    kinds["dp"] = dict(link=links["dp"], plain_b=2 * (dp - 1) / dp * local * grad_bytes,
                       taco_b=2 * (dp - 1) / dp * local * codec.wire_ratio, plain_s=dp_plain,
                       auto_s=dp_taco if dp_taco < dp_plain * (1 - AUTO_MARGIN) else dp_plain)
    bubble = (micro_batches + pp - 1) / micro_batches  # 1F1B: the stage's critical path per micro-batch
    step = {}
    for mode in ("plain", "auto"):
        per_mb = compute_mb + (kinds["tp"][f"{mode}_s"] + kinds["pp"][f"{mode}_s"]) / micro_batches
        step[mode] = bubble * micro_batches * per_mb + kinds["dp"][f"{mode}_s"]
    for k in kinds.values():  # the step time each kind adds (pipelined kinds: through the bubble)
        k["saved_s"] = k["plain_s"] - k["auto_s"]
    kinds["tp"]["saved_s"] *= bubble
    kinds["pp"]["saved_s"] *= bubble
    return dict(kinds=kinds, step_plain_s=step["plain"], step_auto_s=step["auto"],
                speedup=step["plain"] / step["auto"], compute_s=bubble * micro_batches * compute_mb)


def print_traffic(args) -> None:
    preset = PRESETS[args.preset]
    codec = Codec(*args.codec_gbs) if args.codec_gbs else h200_codec(args.copy_gbs)
    print(f"{args.preset}: {preset.params_b}B params, tp {args.tp} x pp {args.pp} x dp {args.dp}, {args.micro_batches} "
          f"micro-batches of {args.tokens} tokens per replica, 1F1B, {args.tflops} TFLOP/s per GPU, gradients "
          f"{'fp32' if args.grad_bytes == 4 else 'bf16'}; per GPU and optimizer step, auto mode per kind")
    print("| cluster | kind | link GB/s | MiB sent plain | MiB sent TACO | comm ms plain | comm ms auto "
          "| step ms saved | step speedup |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.clusters:
        r = project_traffic(preset, args.tp, args.pp, args.dp, args.micro_batches, args.tokens, args.seq, args.tflops,
                            CLUSTERS[name], codec, grad_bytes=args.grad_bytes, piece_bytes=int(args.piece_mib * MiB),
                            host_us=args.host_us, overlap=not args.no_overlap)
        for i, (kind, k) in enumerate(r["kinds"].items()):
            speedup = f"{r['speedup']:.2f}x ({r['step_plain_s'] * 1e3:.0f} -> {r['step_auto_s'] * 1e3:.0f} ms)" \
                if i == 0 else ""
            print(f"| {name if i == 0 else ''} | {kind} | {k['link'].bus_gbs:g} | {k['plain_b'] / MiB:.0f} | "
                  f"{k['taco_b'] / MiB:.0f} | {k['plain_s'] * 1e3:.1f} | {k['auto_s'] * 1e3:.1f} | "
                  f"{k['saved_s'] * 1e3:.1f} | {speedup} |")


def print_projection(args) -> None:
    preset = PRESETS[args.preset]
    codec = Codec(*args.codec_gbs) if args.codec_gbs else h200_codec(args.copy_gbs)
    print(f"{args.preset}: hidden {preset.hidden}, {preset.layers} layers, {preset.params_b}B params, tp {args.tp}, "
          f"{args.tokens} tokens/micro-batch (seq {args.seq}), {args.tflops} TFLOP/s per GPU, pieces "
          f"{args.piece_mib:g} MiB, host {args.host_us:g} us/op, overlap {'on' if not args.no_overlap else 'off'}")
    print("| topology | plain AR | GB/s | msg MiB | plain AR us | TACO AR us | auto | compute ms | exposed comm ms "
          "plain / auto | step speedup auto (always on) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for name in args.topologies:
        link = TOPOLOGIES[name]
        if args.latency_us is not None:
            link = replace(link, latency_us=args.latency_us)
        r = project(preset, args.tp, args.tokens, args.seq, args.tflops, link, codec, int(args.piece_mib * MiB),
                    args.host_us, not args.no_overlap)
        print(f"| {name} | {link.algo} | {link.bus_gbs:g} | {r['message_mib']:.1f} | {r['plain_ar_s'] * 1e6:.0f} | "
              f"{r['taco_ar_s'] * 1e6:.0f} | {'compress' if r['auto_compresses'] else 'plain'} | "
              f"{r['compute_s'] * 1e3:.1f} | {r['comm_plain_s'] * 1e3:.1f} / {r['comm_auto_s'] * 1e3:.1f} | "
              f"{r['speedup']:.2f}x ({r['speedup_on']:.2f}x) |")


def print_pieces(args) -> None:
    """Simulated compressed all-reduce time against piece size, per topology and message."""
    codec = Codec(*args.codec_gbs) if args.codec_gbs else h200_codec(args.copy_gbs)
    pieces = (0, 1, 2, 4, 8, 16, 32)
    print(f"compressed all-reduce, tp {args.tp}, bf16, host {args.host_us:g} us/op: time (us) by piece size (MiB; "
          "0 = whole message), relative to the best in brackets")
    print("| topology | msg MiB | plain | " + " | ".join(str(p) for p in pieces) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(pieces))
    for name in args.topologies:
        link = TOPOLOGIES[name]
        for mib in (8, 16, 32, 64, 128):
            n = int(mib * MiB) // 2
            t = [simulate_all_reduce(n, args.tp, link, codec, int(p * MiB), args.host_us)["total"] for p in pieces]
            best = min(t)
            cells = " | ".join(f"{x * 1e6:.0f} ({x / best:.2f})" for x in t)
            print(f"| {name} | {mib} | {plain_all_reduce_s(n, args.tp, link) * 1e6:.0f} | {cells} |")


# --- validation on gloo (CPU) ------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, init_file: str, numel: int, reps: int, piece_bytes: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from ..codec import TacoConfig, compress, decompress, sum_packed
    from ..comm import all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x = torch.randn(numel) * 0.02
    cfg = TacoConfig()

    def clock(fn):
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    plain = clock(lambda: dist.all_reduce(x.clone()))
    taco = clock(lambda: all_reduce(x, config=cfg, piece_bytes=piece_bytes))
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


def validate_gloo(world: int = 2, sizes=(2**20, 2**22, 2**24), reps: int = 5, piece_bytes: int = 0) -> None:
    """Measure plain and compressed gloo all-reduce and compare with the model's prediction."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    print(f"gloo, {world} ranks on this CPU: measured vs predicted compressed all-reduce (fp32 input, "
          f"pieces {piece_bytes / MiB:g} MiB)")
    print(f"{'elements':>9s} {'plain ms':>9s} {'link GB/s':>9s} {'taco ms':>8s} {'predicted ms':>12s}")
    ctx = mp.get_context("spawn")
    for numel in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_gloo_worker,
                                 args=(r, world, os.path.join(tmp, "s"), numel, reps, piece_bytes, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            m = queue.get(timeout=600)
            for p in procs:
                p.join()
        # the link bandwidth the plain collective achieved defines B for this machine
        link = Link("gloo", bus_gbs=2 * (world - 1) / world * numel * 4 / m["plain"] / 1e9, latency_us=0.0)
        w = m["wire"]
        codec = Codec(
            compress_gbs=(4 * numel + w) / m["compress"] / 1e9,
            sum_gbs=(world + 1) * w / world / m["sum"] / 1e9,
            decompress_gbs=(w + 4 * numel) / m["decompress"] / 1e9,
            compress_us=0.0, sum_us=0.0, decompress_us=0.0,
        )
        predicted = simulate_all_reduce(numel, world, link, codec, piece_bytes, host_us=0.0, elem_bytes=4)["total"]
        print(f"{numel / 2**20:8.1f}M {m['plain'] * 1e3:9.2f} {link.bus_gbs:9.2f} {m['taco'] * 1e3:8.2f} "
              f"{predicted * 1e3:12.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen-7b", choices=sorted(PRESETS))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (b*s)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tflops", type=float, default=400.0, help="achieved dense TFLOP/s per GPU")
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    parser.add_argument("--latency-us", type=float, default=None, help="override every topology's latency")
    parser.add_argument("--host-us", type=float, default=15.0, help="host time per issued operation")
    parser.add_argument("--piece-mib", type=float, default=PIECE_BYTES / MiB, help="default: comm.pieces.PIECE_BYTES")
    parser.add_argument("--no-overlap", action="store_true", help="no compute/communication overlap")
    parser.add_argument("--copy-gbs", type=float, default=4244.0)
    parser.add_argument("--codec-gbs", type=float, nargs=3, metavar=("COMPRESS", "SUM", "DECOMPRESS"))
    parser.add_argument("--pieces", action="store_true", help="time against piece size instead")
    parser.add_argument("--traffic", action="store_true", help="a 3D step's tp, pp and dp traffic per cluster instead")
    parser.add_argument("--pp", type=int, default=2, help="--traffic: pipeline stages")
    parser.add_argument("--dp", type=int, default=4, help="--traffic: data-parallel replicas")
    parser.add_argument("--micro-batches", type=int, default=8, help="--traffic: micro-batches per step and replica")
    parser.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4), help="--traffic: gradient element size")
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    parser.add_argument("--validate-gloo", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if args.validate_gloo:
        validate_gloo(args.world_size, piece_bytes=int(args.piece_mib * MiB))
    elif args.pieces:
        print_pieces(args)
    elif args.traffic:
        print_traffic(args)
    else:
        print_projection(args)


if __name__ == "__main__":
    main()
