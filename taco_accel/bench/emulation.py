"""What emulated TP costs the host: one training step (forward and backward) of the plain model
against emulated tp=2 and 4, compression off and on, on one device.

    python -m taco_accel.bench.emulation                                   # CPU, "tiny" preset
    python -m taco_accel.bench.emulation --device cuda --preset 0.5b --seq 1024 --batch 4
    python -m taco_accel.bench.emulation --device cuda --preset 0.5b --seq 1024 --batch 4 --compile

Per variant, the median over ``--steps`` timed steps (after ``--warmup``):

- ``step ms``: wall time of forward + backward, the device synchronised at both ends;
- ``host ms``: CPU time of this thread over the same span, before the closing synchronisation
  (on a GPU the work the host does to issue the step; on the CPU it includes the arithmetic);
- ``launches``: per step, the kernels a profiler sees on the GPU, the top-level aten ops on the CPU
  (what each costs the host a dispatch);
- ``x plain``: step time over the plain model's.

Emulated TP computes every rank's matmuls on the one device, so on a GPU whose step is not
host-bound the ratio over plain is the codec's work; a host-bound step shows ``host ms`` close to
``step ms``. ``--compile`` runs every variant under ``torch.compile`` (the emulated collectives
are one custom op each, `comm.emulated`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

VARIANTS = (("plain", 1, None), ("tp2 off", 2, "off"), ("tp2 on", 2, "on"), ("tp4 off", 4, "off"),
            ("tp4 on", 4, "on"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(family: str, preset: str, vocab: int, seq: int, device: torch.device, dtype: torch.dtype):
    """The plain transformers model of the recipes' preset, on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from ..training.presets import model_config

    torch.manual_seed(0)
    config = model_config(family, preset, vocab_size=vocab, max_positions=seq)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def variant(model, tp: int, compression: str | None):
    """The plain model (``tp`` 1) or its emulation at ``tp`` with ``compression``."""
    import taco_accel

    if tp == 1:
        return model
    return taco_accel.parallelize(model, tp=tp, compression=compression, emulate=True)


def _step(model, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()
    for p in model.parameters():
        p.grad = None


def launches(model, ids: torch.Tensor, device: torch.device) -> int:
    """Kernels (GPU) or top-level aten ops (CPU) of one step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _step(model, ids)
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    def outermost(e) -> bool:  # an aten op that no other aten op called
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is None

    return sum(1 for e in events if e.name.startswith("aten::") and outermost(e))


def measure(model, ids: torch.Tensor, device: torch.device, steps: int, warmup: int) -> dict:
    """Median step and host milliseconds, and the launches of one step."""
    for _ in range(warmup):
        _step(model, ids)
    walls, hosts = [], []
    for _ in range(steps):
        _sync(device)
        wall, host = time.perf_counter(), time.thread_time()
        _step(model, ids)
        host = time.thread_time() - host
        _sync(device)
        walls.append(time.perf_counter() - wall)
        hosts.append(host)
    return {"step_ms": 1e3 * statistics.median(walls), "host_ms": 1e3 * statistics.median(hosts),
            "launches": launches(model, ids, device)}


def run(family: str = "qwen2", preset: str = "tiny", *, vocab: int = 512, seq: int = 128, batch: int = 2,
        device: str = "cpu", dtype: str | None = None, steps: int = 3, warmup: int = 1, compile: bool = False,
        variants=VARIANTS) -> list[dict]:
    """One row per variant: name, tp, compression, step_ms, host_ms, launches, ratio (over plain)."""
    dev = torch.device(device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    base = build(family, preset, vocab, seq, dev, dt)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    rows = []
    for name, tp, compression in variants:
        model = variant(copy.deepcopy(base), tp, compression)
        if compile:
            torch._dynamo.reset()
            model = torch.compile(model)
        rows.append({"variant": name, "tp": tp, "compression": compression, **measure(model, ids, dev, steps, warmup)})
        del model
    plain = next((r["step_ms"] for r in rows if r["tp"] == 1), None)
    for r in rows:
        r["ratio"] = r["step_ms"] / plain if plain else float("nan")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | step ms | host ms | launches | x plain |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['variant']} | {r['step_ms']:.1f} | {r['host_ms']:.1f} | {r['launches']} | {r['ratio']:.2f} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2", choices=("qwen2", "gpt2"))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="every variant under torch.compile")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="emulated tp degrees")
    args = parser.parse_args(argv)
    variants = [v for v in VARIANTS if v[1] == 1 or v[1] in args.tp]
    rows = run(args.family, args.preset, vocab=args.vocab, seq=args.seq, batch=args.batch, device=args.device,
               dtype=args.dtype, steps=args.steps, warmup=args.warmup, compile=args.compile, variants=variants)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{args.family} {args.preset}, batch {args.batch} x seq {args.seq}, {device}"
          f"{', compiled' if args.compile else ''}, torch {torch.__version__}")
    print(table(rows))


if __name__ == "__main__":
    main()
