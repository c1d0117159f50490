"""Training throughput against what a user gets without taco_accel: tokens/s, MFU, peak memory,
memory held between steps, host syncs, compile time.

    python -m taco_accel.bench.throughput                                  # Qwen2.5-0.5B shapes, the default rows, one GPU
    python -m taco_accel.bench.throughput --rows plain_compiled,cce_compiled,taco_tp1 --rounds 2 --steps 20
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
| ``plain`` | transformers' model in a plain Accelerate loop (``accelerator.backward``, clip, step, ``zero_grad(set_to_none=True)``), transformers' own loss; checkpointing: transformers' own |
| ``plain_compiled`` | the same with ``Accelerator(dynamo_backend="inductor")`` (``torch.compile(model)``, the whole model) |
| ``liger`` / ``liger_compiled`` | the plain loop (eager / compiled) on the model liger-kernel patched as the Trainer's ``use_liger_kernel=True`` does (transformers' ``apply_liger_kernel``: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) |
| ``cce`` / ``cce_compiled`` | the plain loop on the model's body (``model.base_model``; ``_compiled``: ``torch.compile(body)``, as a user compiles it), the loss by Apple's cut-cross-entropy: ``linear_cross_entropy(hidden.bfloat16(), lm_head.weight.bfloat16(), ids, shift=True)``, its default ``filter_eps="high"``, which skips the gradient's entries below bf16's eps / 32 (not exact) |
| ``cce_exact`` / ``cce_exact_compiled`` | the same with ``filter_eps=None``: every gradient entry (cut-cross-entropy's exact setting) |
| ``torch_lce`` / ``torch_lce_compiled`` | the same with torch's own ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13), chunked (``options=torch.nn.LinearCrossEntropyOptions()``, where the release has them; without, torch 2.15 computes the whole logits), on the shifted hidden states and ids in the autocast dtype |
| ``taco_tp1`` | the recipes' `Trainer` at tp=1: per-block compile on CUDA, the fused head and loss |
| ``emulated_tp2`` | the `Trainer` with tp=2 emulated in one process, compression ``auto`` (``emulated_tp{2,4}_{off,on}``: off / on) |

A row that cannot run here is skipped with the reason: a library not installed, the Triton
kernels of liger-kernel and cut-cross-entropy on the CPU, torch's own loss before torch 2.13.

Each row runs in a process of its own (a fresh CUDA context and allocator peak), with an
inductor and Triton cache of its own (``--rounds`` > 1: the row's first round compiles cold, the
later ones find its cache): the first step timed alone (compilation, autotuning, the auto
decisions: ``first step s``), then ``--warmup - 1`` untimed steps, then ``--steps`` timed between
device synchronisations, then one more step whose host syncs are counted (`syncs.HostSyncs`: on
CUDA every wait of the host for the device; on the CPU the reads that would wait on a GPU). MFU
= tokens/s x FLOPs per token / the device's peak dense bf16 rate (``--peak-tflops``; default 989
on an H100 or H200, none elsewhere), FLOPs per token ``6 N + 12 L h s``
(`training.metrics.flops_per_token`: N the parameters without the embedding, the tied head
counted once as a matmul; the second term is attention's score and value matmuls). Peak memory
is ``torch.cuda.max_memory_allocated`` over the timed steps; memory held is
``torch.cuda.memory_allocated`` after the last timed step returned (after its optimizer step:
parameters, optimizer state and whatever the loop keeps until the next step). The losses are
the first and the last step's mean token loss: the plain rows start from the same weights and
batch, so their first losses differ by rounding alone. ``--rounds`` repeats the rows in turn,
every other round in reverse order (rows later in a call can read faster: no row is always
first); the table gives each row's tokens/s per round and the ratio of its mean to the best mean
of the rows not ours (``vs best plain``). A row that fails prints why, and is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from .syncs import HostSyncs

# the plain loop's rows: the loss (the name's stem) x whole model / body compiled or eager
PLAIN_LOSSES = ("plain", "liger", "cce", "cce_exact", "torch_lce")
ROWS = (*(f"{loss}{compiled}" for loss in PLAIN_LOSSES for compiled in ("", "_compiled")),
        "taco_tp1", "emulated_tp2", "emulated_tp2_off", "emulated_tp2_on", "emulated_tp4_off", "emulated_tp4_on")
DEFAULT_ROWS = ("plain", "plain_compiled", "liger", "cce_compiled", "cce_exact_compiled", "torch_lce_compiled",
                "taco_tp1", "emulated_tp2")
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


def needs_gpu(library: str, device: torch.device) -> None:
    """`Skipped` off CUDA: ``library``'s kernels are Triton kernels for GPUs (on CPU tensors they
    fail: "Pointer argument cannot be accessed from Triton")."""
    if device.type != "cuda":
        raise Skipped(f"{library}'s kernels are Triton kernels for CUDA GPUs: no {device.type} row")


def _liger(model, device: torch.device) -> None:
    """What ``TrainingArguments(use_liger_kernel=True)`` applies to the model."""
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.utils import is_liger_kernel_available

    needs_gpu("liger-kernel", device)
    if not is_liger_kernel_available():
        raise Skipped("liger-kernel is not installed (pip install liger-kernel)")
    apply_liger_kernel(model, None)


def cut_cross_entropy(device: torch.device) -> Callable[..., torch.Tensor]:
    """Apple's cut-cross-entropy ``linear_cross_entropy``; `Skipped` where it cannot run."""
    needs_gpu("cut-cross-entropy", device)
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError as e:
        raise Skipped(f"cut-cross-entropy is not installed (pip install cut-cross-entropy): {e}") from None
    return linear_cross_entropy


def torch_linear_cross_entropy() -> Callable[..., torch.Tensor]:
    """torch's own ``F.linear_cross_entropy`` with its chunked options (without them it computes
    the whole logits); `Skipped` before torch 2.13."""
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy"):
        raise Skipped(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch >= 2.13)")
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    chunked = {"options": options()} if options is not None else {}

    def lce(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, **kw) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # its fp32 accumulation stays fp32: the inputs' dtype rules
            return F.linear_cross_entropy(x, w, t, **chunked, **kw)
    return lce


HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def head_loss(loss: str, device: torch.device) -> HeadLoss:
    """``loss(hidden (b, s, h), head weight (V, h), ids (b, s))``: the mean next-token loss of
    the plain rows that take the body's hidden states (`ROWS`' ``cce``, ``cce_exact``,
    ``torch_lce``); `Skipped` where it cannot run here."""
    if loss in ("cce", "cce_exact"):
        cce = cut_cross_entropy(device)
        exact = {"filter_eps": None} if loss == "cce_exact" else {}  # the default skips small gradient entries
        return lambda h, w, ids: cce(h.bfloat16(), w.bfloat16(), ids, shift=True, **exact)
    if loss == "torch_lce":
        lce = torch_linear_cross_entropy()
        dtype = torch.bfloat16 if device.type == "cuda" else None  # the autocast dtype, as the head's matmul

        def shifted(h, w, ids):
            h, w = (h, w) if dtype is None else (h.to(dtype), w.to(dtype))
            return lce(h[:, :-1].reshape(-1, h.shape[-1]), w, ids[:, 1:].reshape(-1))
        return shifted
    raise ValueError(f"loss {loss!r}: use cce, cce_exact or torch_lce")


def _plain_row(args, loss: str, compiled: bool, device: torch.device) -> tuple:
    """One AdamW step function of transformers' model in a plain Accelerate loop, with ``loss``
    (`PLAIN_LOSSES`): the model's own (plain, liger; compiled: the whole model) or a head loss
    on the body's hidden states (compiled: the body)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    own_loss = loss in ("plain", "liger")
    on_hidden = None if own_loss else head_loss(loss, device)  # skips before the model is built
    _, batches = _data(args.seq_len, args.micro_batch_size * args.micro_batches)
    config = _config(args.preset, args.seq_len, args.vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if loss == "liger":
        _liger(model, device)
    if args.activation_checkpointing:  # transformers' own, under the name this release has
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    acc = Accelerator(mixed_precision="bf16" if device.type == "cuda" else "no", cpu=device.type == "cpu",
                      dynamo_backend="inductor" if compiled and own_loss else "no")
    flops = _flops_per_token(model, config, args.seq_len)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), **fused)
    model, optimizer = acc.prepare(model, optimizer)
    inner = acc.unwrap_model(model)
    body, weight = inner.base_model, inner.get_output_embeddings().weight
    body = torch.compile(body) if compiled and not own_loss else body

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with acc.autocast():
            if own_loss:
                return model(input_ids=ids, labels=ids).loss
            hidden = body(input_ids=ids).last_hidden_state
        return on_hidden(hidden, weight, ids)  # outside autocast: the loss takes its inputs' dtype
    state = {"step": 0}

    def step() -> torch.Tensor:
        inputs, _ = batches.batch(state["step"])
        total = torch.zeros((), device=acc.device)
        for ids in inputs.to(acc.device).chunk(args.micro_batches):
            loss = forward(ids) / args.micro_batches
            acc.backward(loss)
            total += loss.detach()
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        return total

    return step, flops


def _taco_row(args, tp: int, compression: str, device: torch.device) -> tuple:
    """One step of the recipes' `Trainer` (tp > 1: emulated in this process)."""
    from ..training import TrainConfig, Trainer

    cfg = TrainConfig(family="qwen2", preset=args.preset, tp=tp, compression=compression, seq_len=args.seq_len,
                      model_overrides={"vocab_size": args.vocab},
                      micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches,
                      steps=args.warmup + args.steps + 1, warmup_steps=1, eval_every=0, output_dir=None, export=False,
                      plot=False, trackers=(), progress=False, device=device.type,
                      mixed_precision="bf16" if device.type == "cuda" else "no", compile=args.compile,
                      activation_checkpointing=args.activation_checkpointing)
    trainer = Trainer(cfg)
    return (lambda: trainer.train_step()["loss"]), trainer.flops_per_token


def _row_step(row: str, args, device: torch.device) -> tuple:
    """``(step function returning the step's mean loss, FLOPs per token)`` of ``row``."""
    stem = row.removesuffix("_compiled")
    if stem in PLAIN_LOSSES:
        return _plain_row(args, stem, row.endswith("_compiled"), device)
    if row == "taco_tp1":
        return _taco_row(args, 1, "off", device)
    if row.startswith("emulated_tp"):
        tp, _, mode = row[len("emulated_tp"):].partition("_")
        return _taco_row(args, int(tp), mode or "auto", device)
    raise ValueError(f"row {row!r}: use one of {', '.join(ROWS)}")


def measure(row: str, args) -> dict:
    """Tokens/s, MFU, peak memory, memory held between steps, host syncs a step, first-step time
    and losses of ``row`` (`ROWS`), in this process; ``{"row", "skipped": why}`` where it cannot
    run here."""
    device = torch.device(args.device)
    try:
        step, flops = _row_step(row, args, device)
    except Skipped as why:
        return {"row": row, "skipped": str(why)}
    start = time.perf_counter()
    first_loss = step()  # compilation, autotuning, the auto decisions
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
    cuda = device.type == "cuda"
    held = torch.cuda.memory_allocated(device) / 2**30 if cuda else None  # after the optimizer step
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    with HostSyncs(device) as syncs:  # one more step, untimed: the counting slows it
        last_loss = step()
    _sync(device)
    tokens = args.micro_batch_size * args.micro_batches * args.seq_len
    peak = args.peak_tflops or _peak_tflops(device)
    return {
        "row": row, "step_s": seconds, "tokens_per_s": tokens / seconds, "first_step_s": first,
        "tflops": flops * tokens / seconds / 1e12,
        "mfu": flops * tokens / seconds / 1e12 / peak if peak else None,
        "peak_mem_gib": peak_mem, "held_gib": held, "host_syncs": syncs.count,
        "first_loss": float(first_loss), "last_loss": float(last_loss),
    }


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def in_fresh_process(module: str, key: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
    """``python -m <module> <argv> --only <name>`` in a fresh interpreter (no parent launch's rank
    variables; ``env`` added): the last JSON line it printed, or ``{key: name, "error": why}``
    (`failure`)."""
    cmd = [sys.executable, "-m", module, *argv, "--only", name]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))},
           **(env or {})}
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


def ours(row: str) -> bool:
    """Whether ``row`` runs taco_accel (the others are the baselines: `vs best plain`)."""
    return row.startswith(("taco_", "emulated_"))


def table(results: list[dict], args) -> str:
    """The rows as a markdown table, one line per row (its rounds together, in the order first
    run): tokens/s of each round, the mean's ratio to the best mean of the rows not ours, the
    first round's first step (cold compile caches) and the others' (cached)."""
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    mean = {row: statistics.mean(r["tokens_per_s"] for r in runs) for row, runs in by_row.items()
            if all("tokens_per_s" in r for r in runs)}
    base = max((v for row, v in mean.items() if not ours(row)), default=None)
    checkpointed = ", activation checkpointing" if args.activation_checkpointing else ""
    lines = [f"qwen2 {args.preset}, vocabulary {args.vocab}, seq {args.seq_len}, micro-batch {args.micro_batch_size} x "
             f"{args.micro_batches}{checkpointed}, {args.device}, {args.steps} timed steps", "",
             "| row | tokens/s | vs best plain | MFU | peak GiB | held GiB | host syncs / step | step ms "
             "| first step s | loss first / last |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row, runs in by_row.items():
        bad = next((r for r in runs if "error" in r or "skipped" in r), None)
        if bad is not None:
            why = f"failed: {' / '.join(bad['error'])}" if "error" in bad else f"skipped: {bad['skipped']}"
            lines.append(f"| {row} | {why} | | | | | | | | |")
            continue
        last, cuda = runs[-1], runs[-1]["peak_mem_gib"] is not None
        tokens = " / ".join(format(r["tokens_per_s"], ".0f") for r in runs)
        ratio = format(mean[row] / base, ".2f") if base else "-"
        mfu = "-" if last["mfu"] is None else format(100 * statistics.mean(r["mfu"] for r in runs), ".1f") + "%"
        peak = format(max(r["peak_mem_gib"] for r in runs), ".2f") if cuda else "-"
        held = format(last["held_gib"], ".2f") if cuda else "-"
        syncs = " / ".join(str(r["host_syncs"]) for r in runs)
        step_ms = format(1e3 * statistics.mean(r["step_s"] for r in runs), ".1f")
        first = " / ".join(format(r["first_step_s"], ".1f") for r in runs)
        losses = f"{last['first_loss']:.4f} / {last['last_loss']:.4f}"
        cells = (row, tokens, ratio, mfu, peak, held, syncs, step_ms, first, losses)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="0.5b", help="the recipes' Qwen2 preset (0.5b, 1.5b, 3b: Qwen2.5's shapes)")
    p.add_argument("--vocab", type=int, default=QWEN25_VOCAB, help="vocabulary size (default: Qwen2.5's)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows, from " + ", ".join(ROWS))
    p.add_argument("--rounds", type=int, default=1,
                   help="run the rows in turn this many times, every other round in reverse order")
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
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        raise SystemExit(f"--warmup {args.warmup} --steps {args.steps} --rounds {args.rounds}: each must be >= 1 "
                         "(the first step compiles)")
    if args.only:
        print(json.dumps(measure(args.only, args)), flush=True)
        return []
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: use {', '.join(ROWS)}")
    results, settled = [], set()  # settled: rows skipped or failed once, not run again
    child_argv = _without(argv, ("--rows", "--json", "--rounds"))
    caches = tempfile.mkdtemp(prefix="taco-bench-compile-")
    try:
        for round_ in range(args.rounds):
            for row in (r for r in (rows[::-1] if round_ % 2 else rows) if r not in settled):
                cache = os.path.join(caches, row)  # the row's own: cold in its first round, warm after
                results.append(in_fresh_process("taco_accel.bench.throughput", "row", row, child_argv,
                                                env={"TORCHINDUCTOR_CACHE_DIR": cache,
                                                     "TRITON_CACHE_DIR": os.path.join(cache, "triton")}))
                print(json.dumps(results[-1]), flush=True)
                if "error" in results[-1] or "skipped" in results[-1]:
                    settled.add(row)
    finally:
        shutil.rmtree(caches, ignore_errors=True)
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
