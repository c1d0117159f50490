"""Training throughput against what a user gets without taco_accel: tokens/s, MFU, peak memory,
compile time.

    python -m taco_accel.bench.throughput                                  # Qwen2.5-0.5B shapes, every row, one GPU
    python -m taco_accel.bench.throughput --preset 1.5b --rows plain_compiled,taco_tp1
    python -m taco_accel.bench.throughput --preset 3b --activation-checkpointing
    python -m taco_accel.bench.throughput --device cpu --preset nano --vocab 384 --seq-len 32 --steps 1

Every row trains the same model (the recipes' Qwen2 preset: 0.5b, 1.5b and 3b are Qwen2.5's shapes,
tied embeddings; ``--vocab`` its vocabulary, Qwen2.5's 151,936 by default) on the same batches
(``--micro-batch-size`` windows of ``--seq-len`` tokens of the recipes' packed corpus,
``--micro-batches`` accumulated per AdamW step), bf16 autocast and fused AdamW on CUDA, gradient
clipping at 1.0, each decoder layer recomputed in backward with ``--activation-checkpointing``:

| row | what runs |
| --- | --- |
| ``plain`` | transformers' model in a plain Accelerate loop (``accelerator.backward``, clip, step); checkpointing: transformers' own |
| ``plain_compiled`` | the same with ``Accelerator(dynamo_backend="inductor")`` (``torch.compile(model)``) |
| ``liger`` / ``liger_compiled`` | the plain loop (eager / compiled) on the model liger-kernel patched as the Trainer's ``use_liger_kernel=True`` does (transformers' ``apply_liger_kernel``: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE); skipped, saying so, without liger-kernel |
| ``taco_tp1`` | the recipes' `Trainer` at tp=1: per-block compile on CUDA, the fused head and loss (``logits="none"``) |
| ``emulated_tp2`` | the `Trainer` with tp=2 emulated in one process, compression ``auto`` (``emulated_tp{2,4}_{off,on}``: off / on) |

Each row runs in a process of its own (a fresh CUDA context, compile caches and allocator peak):
the first step timed alone (compilation, autotuning, the auto decisions: ``first step s``), then
``--warmup - 1`` untimed steps, then ``--steps`` timed between device synchronisations. MFU =
tokens/s x FLOPs per token / the device's peak dense bf16 rate (``--peak-tflops``; default 989
on an H100 or H200, none elsewhere), FLOPs per token ``6 N + 12 L h s``
(`training.metrics.flops_per_token`: N the parameters without the embedding, the tied head
counted once as a matmul; the second term is attention's score and value matmuls). Peak memory
is ``torch.cuda.max_memory_allocated`` over the timed steps. A row that fails prints why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

ROWS = ("plain", "plain_compiled", "liger", "liger_compiled", "taco_tp1", "emulated_tp2", "emulated_tp2_off",
        "emulated_tp2_on", "emulated_tp4_off", "emulated_tp4_on")
DEFAULT_ROWS = ("plain", "plain_compiled", "liger", "liger_compiled", "taco_tp1", "emulated_tp2")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM datasheets
QWEN25_VOCAB = 151_936


class Skipped(Exception):
    """A row that cannot run here, and why (e.g. a library that is not installed)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _data(seq_len: int, batch: int):
    """The recipes' byte tokenizer and packed training windows of the shipped corpus."""
    from ..data import PackedBatches
    from ..training.trainer import pretraining_tokens

    tok, train, _ = pretraining_tokens(None, "byte", None)
    return tok, PackedBatches(train, seq_len, batch, 0, 1, seed=0)


def _config(preset: str, seq_len: int, vocab: int):
    from ..training.presets import model_config

    return model_config("qwen2", preset, vocab_size=vocab, max_positions=seq_len)


def _flops_per_token(model, config, seq_len: int) -> float:
    from ..training.metrics import flops_per_token

    params = sum(p.numel() for p in model.parameters())  # a tied head counts once here...
    embed = model.get_input_embeddings().weight.numel()
    head = model.lm_head.weight.numel() if config.tie_word_embeddings else 0  # ...and once as the head's matmul
    return flops_per_token(config, params + head, embed, seq_len)


def _liger(model) -> None:
    """What ``TrainingArguments(use_liger_kernel=True)`` applies to the model (Skipped without liger-kernel)."""
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise Skipped("liger-kernel is not installed (pip install liger-kernel)")
    apply_liger_kernel(model, None)


def _plain_row(args, compiled: bool, liger: bool, device: torch.device) -> tuple:
    """One AdamW step function of transformers' model in a plain Accelerate loop."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    _, batches = _data(args.seq_len, args.micro_batch_size * args.micro_batches)
    config = _config(args.preset, args.seq_len, args.vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if liger:
        _liger(model)
    if args.activation_checkpointing:  # transformers' own, under the name this release has
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    acc = Accelerator(mixed_precision="bf16" if device.type == "cuda" else "no", cpu=device.type == "cpu",
                      dynamo_backend="inductor" if compiled else "no")
    flops = _flops_per_token(model, config, args.seq_len)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), **fused)
    model, optimizer = acc.prepare(model, optimizer)
    state = {"step": 0}

    def step() -> None:
        inputs, _ = batches.batch(state["step"])
        for ids in inputs.to(acc.device).chunk(args.micro_batches):
            with acc.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss / args.micro_batches)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1

    return step, flops


def _taco_row(args, tp: int, compression: str, device: torch.device) -> tuple:
    """One step of the recipes' `Trainer` (tp > 1: emulated in this process)."""
    from ..training import TrainConfig, Trainer

    cfg = TrainConfig(family="qwen2", preset=args.preset, tp=tp, compression=compression, seq_len=args.seq_len,
                      model_overrides={"vocab_size": args.vocab},
                      micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches,
                      steps=args.warmup + args.steps, warmup_steps=1, eval_every=0, output_dir=None, export=False,
                      plot=False, trackers=(), progress=False, device=device.type,
                      mixed_precision="bf16" if device.type == "cuda" else "no", compile=args.compile,
                      activation_checkpointing=args.activation_checkpointing)
    trainer = Trainer(cfg)
    return trainer.train_step, trainer.flops_per_token


def _row_step(row: str, args, device: torch.device) -> tuple:
    """``(step function, FLOPs per token)`` of ``row``."""
    if row in ("plain", "plain_compiled", "liger", "liger_compiled"):
        return _plain_row(args, row.endswith("_compiled"), row.startswith("liger"), device)
    if row == "taco_tp1":
        return _taco_row(args, 1, "off", device)
    if row.startswith("emulated_tp"):
        tp, _, mode = row[len("emulated_tp"):].partition("_")
        return _taco_row(args, int(tp), mode or "auto", device)
    raise ValueError(f"row {row!r}: use one of {', '.join(ROWS)}")


def measure(row: str, args) -> dict:
    """Tokens/s, MFU, peak memory and first-step time of ``row`` (`ROWS`), in this process;
    ``{"row", "skipped": why}`` where it cannot run here."""
    device = torch.device(args.device)
    try:
        step, flops = _row_step(row, args, device)
    except Skipped as why:
        return {"row": row, "skipped": str(why)}
    start = time.perf_counter()
    step()  # compilation, autotuning, the auto decisions
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.micro_batch_size * args.micro_batches * args.seq_len
    peak = args.peak_tflops or _peak_tflops(device)
    return {
        "row": row, "step_s": seconds, "tokens_per_s": tokens / seconds, "first_step_s": first,
        "tflops": flops * tokens / seconds / 1e12,
        "mfu": flops * tokens / seconds / 1e12 / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def in_fresh_process(module: str, key: str, name: str, argv: list[str]) -> dict:
    """``python -m <module> <argv> --only <name>`` in a fresh interpreter (no parent launch's rank
    variables): the last JSON line it printed, or ``{key: name, "error": why}`` (`failure`)."""
    cmd = [sys.executable, "-m", module, *argv, "--only", name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {key: name, "error": failure(done.stderr or done.stdout)}
    return json.loads(lines[-1])


def failure(output: str) -> list[str]:
    """Why a row failed, from its process's output: the last line that raises (``Name: message``,
    at the start of a line, as a traceback ends), else the output's last 3 lines (dynamo, for one,
    prints advice after the exception)."""
    lines = output.strip().splitlines()
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*: ", line)]
    return raised[-1:] if raised else lines[-3:]


def table(results: list[dict], args) -> str:
    """The rows as a markdown table, with each row's step time over ``plain_compiled``'s."""
    base = next((r["step_s"] for r in results if r.get("row") == "plain_compiled" and "step_s" in r), None)
    checkpointed = ", activation checkpointing" if args.activation_checkpointing else ""
    lines = [f"qwen2 {args.preset}, vocabulary {args.vocab}, seq {args.seq_len}, micro-batch {args.micro_batch_size} x "
             f"{args.micro_batches}{checkpointed}, {args.device}", "",
             "| row | tokens/s | TFLOPS | MFU | peak GiB | step ms | first step s | step / compiled plain |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r or "skipped" in r:
            why = f"failed: {' / '.join(r['error'])}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['row']} | {why} | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        ratio = f"{r['step_s'] / base:.2f}" if base else "-"
        lines.append(f"| {r['row']} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {mfu} | {mem} | "
                     f"{1e3 * r['step_s']:.1f} | {r['first_step_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="0.5b", help="the recipes' Qwen2 preset (0.5b, 1.5b, 3b: Qwen2.5's shapes)")
    p.add_argument("--vocab", type=int, default=QWEN25_VOCAB, help="vocabulary size (default: Qwen2.5's)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows, from " + ", ".join(ROWS))
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, the first one timed alone (compilation)")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the taco rows' compile (default: the recipes', on with CUDA)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: 989 on H100/H200)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one row, in this process (what each subprocess runs)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit(f"--warmup {args.warmup} --steps {args.steps}: each must be >= 1 (the first step compiles)")
    if args.only:
        print(json.dumps(measure(args.only, args)), flush=True)
        return []
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: use {', '.join(ROWS)}")
    results = []
    for row in rows:
        results.append(in_fresh_process("taco_accel.bench.throughput", "row", row, _without(argv, ("--rows", "--json"))))
        print(json.dumps(results[-1]), flush=True)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
