"""One training step at every door a user trains through, watched: its host syncs and its tensors.

A door runs `STEPS` optimizer steps of a tiny Qwen2 (2 layers, hidden 64, a vocabulary of `VOCAB`)
on batches of `TOKENS` tokens per forward; the last step runs inside a `Probe` (the first builds
what is built once: optimizer states, the agreed batch shape). The probe covers one step as the
loop runs it: the batch fetched and moved, forward and backward, clipping, the optimizer step,
the loss read for the log (the Trainer's: a step without a log line). It records the step's host
syncs (`taco_accel.bench.syncs.HostSyncs`), the largest tensor any op made (`LargestOutputs`), and
after the step how many parameters still hold a gradient.

Doors (``door(tp, folder)`` in a rank of `harness.run_ranks` with ``tp`` processes; tp=1 as a
process of its own, `_one_process`):

- ``plain``: a plain Accelerate loop (``accelerate.Accelerator``), the reference of the next three;
- ``loop``: the same loop on ``taco_accel.Accelerator(logits="none")``, with its ``clip_grad_norm_``;
- ``finetuner``: the Finetuner's step (full fine-tuning, one micro-batch);
- ``recipes``: the recipes' pretraining ``Trainer``'s step;
- ``plain_trainer``: transformers' ``Trainer``, the reference of the next;
- ``trainer``: ``taco_trainer(Trainer)``.

The batches are padded at their ends (an SFT batch's attention mask), but the recipes' packed windows.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from taco_accel.bench.syncs import HostSyncs, optimizer_host_state

VOCAB = 4096
BATCH, SEQ = 4, 64  # one forward: TOKENS tokens, more than the hidden size (a head gradient is V/tp x 64)
TOKENS = BATCH * SEQ
CHUNK = 32  # tokens per chunk of the fused loss: several chunks per forward
STEPS = 2  # the last one is watched
SFT_DATA = Path(__file__).resolve().parents[1] / "recipes" / "data" / "sft_sample.jsonl"


class LargestOutputs(TorchDispatchMode):
    """The output shapes of every op in a block: ``largest`` (numel, op, shape) and those of at
    least ``limit`` elements (``over``, the first 20)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.largest, self.over = limit, (0, "", ()), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                seen = (t.numel(), str(func), tuple(t.shape))
                self.largest = max(self.largest, seen)
                if t.numel() >= self.limit and len(self.over) < 20:
                    self.over.append(seen)
        return out


class Probe:
    """Both watches over one step: its host syncs (`HostSyncs`) and its largest tensors
    (`LargestOutputs`, limit: the logits of one forward, ``TOKENS x VOCAB / tp`` elements)."""

    def __init__(self, tp: int) -> None:
        self.tp, self.syncs, self.shapes = tp, None, None

    def open(self, device, host=()) -> None:
        self.syncs = HostSyncs(device, host)
        self.shapes = LargestOutputs(TOKENS * VOCAB // self.tp)
        self.syncs.__enter__()
        self.shapes.__enter__()

    def close(self) -> None:
        self.shapes.__exit__(None, None, None)
        self.syncs.__exit__(None, None, None)

    def result(self, **extra) -> dict:
        return {"syncs": self.syncs.count, "events": self.syncs.events, "largest": self.shapes.largest,
                "over": self.shapes.over, **extra}


def grads_held(params) -> int:
    """How many of ``params`` hold a gradient (after a step: none, as a plain loop leaves them)."""
    return sum(p.grad is not None for p in params)


def tiny(seed: int = 0):
    from taco_accel.models.tiny import tiny_model

    return tiny_model("qwen2", seed=seed, vocab_size=VOCAB, max_position_embeddings=SEQ)


def host_tensors(*objects) -> list[torch.Tensor]:
    """The tensors held by ``objects`` (rows, a batch source's attributes): where a step reads its
    data from, on the host on a GPU too."""
    out = []
    for obj in objects:
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else vars(obj).values()
        for value in values:
            out += [value] if torch.is_tensor(value) else host_tensors(value) if isinstance(value, (dict, list)) else []
    return out


def rows(n: int, seed: int = 1) -> list[dict]:
    """Token rows, each padded at its end (0 to 7 tokens masked out): the attention mask of an SFT batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = torch.ones_like(ids)
        mask[SEQ - i % 8:] = 0
        out.append({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask})
    return out


def small_chunks(model) -> None:
    """The fused loss of ``model`` (whose head and loss taco_accel installed) in chunks of `CHUNK` tokens."""
    from taco_accel.models.loss import head_of

    head = head_of(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no taco_accel head and loss")
    head.chunk = CHUNK


# -- a user's own loop ---------------------------------------------------------------------------

def _loop(accelerator, tp: int) -> dict:
    from torch.utils.data import DataLoader

    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = rows((STEPS + 1) * BATCH)  # Accelerate's loader moves the next batch while yielding one
    loader = DataLoader(data, batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if getattr(accelerator, "laid_out", None) is not None:  # taco_accel's
        small_chunks(model)
    probe, batches = Probe(tp), iter(loader)
    for step in range(STEPS):
        if step == STEPS - 1:
            probe.open(accelerator.device, [*optimizer_host_state(optimizer), *host_tensors(data)])
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # the log's read
    probe.close()
    return probe.result(grads_held=grads_held(model.parameters()))


def plain(tp: int, folder: str) -> dict:
    from accelerate import Accelerator

    return _loop(Accelerator(cpu=True), tp)


def loop(tp: int, folder: str) -> dict:
    from accelerate import ParallelismConfig

    from taco_accel import Accelerator

    return _loop(Accelerator(parallelism_config=ParallelismConfig(tp_size=tp), compression=None, logits="none"), tp)


# -- the recipes ---------------------------------------------------------------------------------

def _run_watched(cls, config, tp: int, host_of) -> dict:
    """``cls(config).train()`` (a `TrainingLoop`) with its last step in a `Probe`."""
    probe, out = Probe(tp), {}

    class Watched(cls):
        def _build_optimizer(self):
            small_chunks(self.model)
            super()._build_optimizer()

        def train_step(self):
            if self.step != STEPS - 1:
                return super().train_step()
            probe.open(self.device, [*optimizer_host_state(self.optimizer), *host_of(self)])
            try:
                return super().train_step()
            finally:
                probe.close()
                out.update(probe.result(grads_held=grads_held(self.optimizer.param_groups[0]["params"])))

    Watched(config).train()
    return out


def finetuner(tp: int, folder: str) -> dict:
    from taco_accel.training.finetune import FinetuneConfig, Finetuner

    base = Path(folder) / "base"
    if int(os.environ.get("RANK", "0")) == 0 and not (base / "config.json").exists():
        from taco_accel.data import build_tokenizer

        tiny().save_pretrained(base)
        build_tokenizer("byte").save_pretrained(base)
    _barrier()
    config = FinetuneConfig(
        model=str(base), data=str(SFT_DATA), method="full", max_len=SEQ, micro_batch_size=BATCH, micro_batches=1,
        steps=STEPS, warmup_steps=0, eval_every=0, max_eval_examples=4, trackers=(), progress=False, plot=False,
        export=False, device="cpu", compression=None, tp=tp, output_dir=str(Path(folder) / "run"))
    return _run_watched(Finetuner, config, tp, lambda run: [])


def recipes(tp: int, folder: str) -> dict:
    from harness import random_tokens_trainer

    from taco_accel.training import TrainConfig

    RandomTokens = random_tokens_trainer(VOCAB, 8192, 1024)

    config = TrainConfig(
        family="qwen2", preset="nano", model_overrides={"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2},
        seq_len=SEQ, micro_batch_size=BATCH, micro_batches=1, steps=STEPS, warmup_steps=0, eval_every=0,
        eval_batches=1, trackers=(), progress=False, export=False, plot=False, output_dir=None, compression=None,
        device="cpu", tp=tp)
    return _run_watched(RandomTokens, config, tp, lambda run: host_tensors(run.batches))


# -- transformers' Trainer ---------------------------------------------------------------------

def _trainer(cls, tp: int, folder: str) -> dict:
    from accelerate import ParallelismConfig
    from transformers import TrainerCallback, TrainingArguments

    probe, out = Probe(tp), {}

    class Watch(TrainerCallback):
        """From the end of step 1 to the end of the last (a step without a log line: ``logging_steps``)."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if hasattr(trainer.accelerator, "laid_out"):  # taco_trainer's: laid out by its prepare
                small_chunks(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == STEPS - 1:
                probe.open(trainer.accelerator.device, [*optimizer_host_state(trainer.optimizer), *host_tensors(data)])
            elif state.global_step == STEPS:
                probe.close()
                out.update(probe.result(grads_held=grads_held(model.parameters())))

    args = TrainingArguments(
        output_dir=str(Path(folder) / cls.__name__), per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=STEPS + 1, report_to=[], save_strategy="no",
        disable_tqdm=True, use_cpu=True, **({"parallelism_config": ParallelismConfig(tp_size=tp)} if tp > 1 else {}))
    data = rows((STEPS + 1) * BATCH)  # Accelerate's loader moves the next batch while yielding one
    trainer = cls(model=tiny(), args=args, train_dataset=data, callbacks=[Watch()])
    trainer.train()
    return out


def plain_trainer(tp: int, folder: str) -> dict:
    from transformers import Trainer

    return _trainer(Trainer, tp, folder)


def trainer(tp: int, folder: str) -> dict:
    from transformers import Trainer

    import taco_accel

    return _trainer(taco_accel.taco_trainer(Trainer, compression=None), tp, folder)


DOORS = {"plain": plain, "loop": loop, "finetuner": finetuner, "recipes": recipes, "plain_trainer": plain_trainer,
         "trainer": trainer}
PLAIN = {"loop": "plain", "finetuner": "plain", "recipes": "plain", "trainer": "plain_trainer"}


def _one_process() -> None:
    """This rank of `run_ranks` as ``python script.py`` is: no process group, no launcher's variables
    (else Accelerate and the Trainer run a one-process DDP)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def run_doors(doors: list[str], tp: int, folder: str) -> dict:
    """``{door: its `Probe` result or error}`` of every door in ``doors`` at ``tp`` (`harness.per_case`),
    each in a fresh Accelerate state; at tp=1 each as in a process of its own (`_one_process`)."""
    from accelerate.state import AcceleratorState, GradientState

    from harness import per_case

    def one(door):
        if tp == 1:
            _one_process()
        AcceleratorState._reset_state()
        GradientState._reset_state()
        return DOORS[door](tp, os.path.join(folder, door))

    return per_case({door: functools.partial(one, door) for door in doors})
