"""How much TP communication the layers hide behind compute: a decoder layer with and without overlap.

    python -m taco_accel.bench.overlap                      # 2 gloo ranks on this CPU
    python -m taco_accel.bench.overlap --sp --hidden 512    # sequence parallel, a smaller layer
    torchrun --nproc-per-node 2 -m taco_accel.bench.overlap --backend nccl

One Llama decoder layer (plus a small embedding and lm head), parallelised with `parallelize`,
runs forward and backward with ``model.taco.overlap.enabled`` on and off (interleaved, median of
``--reps``). Timestamps, not a profiler: `CommClock` adds up the host time spent inside the
communication calls (issuing a collective, and waiting for it: `comm.Call`'s steps), i.e. the
communication the pass did not hide. Without overlap every
collective blocks for its whole duration; with it, only the part not covered by compute.
The hidden fraction is ``1 - exposed(on) / exposed(off)``. Both modes send the same bytes
(checked from `pop_comm_stats`).

On gloo the transfers run on gloo's threads while the main thread multiplies; with 2 ranks on
2 cores they compete for the cores, so the CPU figure is a lower bound of what a GPU (NCCL on
its own stream) can hide. On NCCL a wait does not block the host: use a profiler there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from .. import comm


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    import taco_accel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=256,
                         max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)
    compression = taco_accel.TacoConfig() if args.compressed else "off"
    return taco_accel.parallelize(model, compression=compression, sequence_parallel=args.sp).to(device)


class CommClock:
    """Adds up the host seconds spent inside the communication calls of `comm` (patched on the
    classes while active; one process)."""

    def __init__(self) -> None:
        from ..comm.call import Call

        self.seconds = 0.0
        self._targets = [(Call, name) for name in ("__init__", "start", "wait", "gather", "scatter", "submit")]
        self._iter = Call.landed
        self._saved = []

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def __enter__(self):
        from ..comm.call import Call

        for cls, name in self._targets:
            original = cls.__dict__[name]
            self._saved.append((cls, name, original))
            setattr(cls, name, self._timed(original))
        clock, iterate = self, self._iter

        def timed_iter(parts):  # only the waits between the parts, not the caller's matmuls
            it = iterate(parts)
            while True:
                start = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    clock.seconds += time.perf_counter() - start
                    return
                clock.seconds += time.perf_counter() - start
                yield item

        Call.landed = timed_iter
        return self

    def __exit__(self, *exc):
        from ..comm.call import Call

        for cls, name, original in self._saved:
            setattr(cls, name, original)
        Call.landed = self._iter


def measure(args) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    model = _model(args, device)
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {(e, p): [] for e in (True, False) for p in ("fwd", "bwd")}  # (seconds, exposed comm seconds)
    traffic = {}
    for rep in range(args.reps + 1):  # the first round warms up (and takes any auto decision)
        for enabled in (True, False):
            model.taco.overlap.enabled = enabled
            model.zero_grad(set_to_none=True)
            comm.pop_comm_stats()
            holder = {}
            for name, step in (("fwd", lambda: holder.setdefault("loss", model(ids, labels=ids).loss)),
                               ("bwd", lambda: holder["loss"].backward())):
                with CommClock() as clock:
                    seconds = _timed(step, device)
                if rep:
                    runs[enabled, name].append((seconds, clock.seconds))
            traffic[enabled] = {k: (v.calls, v.bytes_sent) for k, v in comm.pop_comm_stats().items()}
    med = {key: tuple(statistics.median(v[i] for v in values) for i in (0, 1)) for key, values in runs.items()}
    return dict(times=med, same_traffic=traffic[True] == traffic[False])


def report(args, r: dict) -> None:
    world = dist.get_world_size()
    t = r["times"]
    print(f"# {world} ranks, {args.backend}, Llama layer hidden {args.hidden}, seq {args.seq}, sequence parallel "
          f"{args.sp}, compression {'on' if args.compressed else 'off'}, median of {args.reps}, torch "
          f"{torch.__version__}; same bytes with and without overlap: {r['same_traffic']}")
    print("| pass | time off ms | time on ms | exposed comm off ms | exposed comm on ms | hidden |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for p in ("fwd", "bwd"):
        (off, comm_off), (on, comm_on) = t[False, p], t[True, p]
        hidden = f"{max(0.0, 1 - comm_on / comm_off):.0%}" if comm_off > 0 else "-"
        print(f"| {p} | {off * 1e3:.1f} | {on * 1e3:.1f} | {comm_off * 1e3:.1f} | {comm_on * 1e3:.1f} | {hidden} |")


def _rank(rank: int, world: int, init_file: str, args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = measure(args)
        if rank == 0:
            report(args, result)
        dist.barrier()  # leave together: gloo's teardown aborted a rank now and then when one left early
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m taco_accel.bench.overlap", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--compressed", action="store_true", help="compress every message (compression=TacoConfig())")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(args.backend)
        try:
            result = measure(args)
            if dist.get_rank() == 0:
                report(args, result)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.world_size, os.path.join(tmp, "store"), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
