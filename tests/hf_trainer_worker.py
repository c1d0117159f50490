"""transformers' Trainer and TRL's SFTTrainer and DPOTrainer as a user runs them, with and without taco_accel.

``accelerate launch ... hf_trainer_worker.py --out OUT --dir DIR`` trains with
``taco_trainer(Trainer)`` / ``taco_trainer(SFTTrainer)`` (the two changed lines) on the launch's
mesh; ``python hf_trainer_worker.py --reference --dp N ...`` runs the plain classes in one process
on the same global batches (per-device batch x N). tests/test_hf_trainer.py starts both and
compares what they wrote: per run, the logged losses, gradient norms, learning rates and
evaluation metrics (rank 0's ``log_history``), and the saved model or adapter under DIR.
Each run is guarded on its own: a failure is recorded under its name and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

BATCH, ACCUM, STEPS, SEQ = 2, 2, 4, 16
# The Trainer normalises an evaluation batch's loss by the tokens of the global batch, padding
# repeats included: the set divides into every global batch, so no batch is padded
EVAL = 8
VOCAB = 257  # the byte tokenizer's; uneven vocabulary slices over tp=2 (129 + 128)


def tiny(seed: int = 0):
    from taco_accel.models.tiny import tiny_model

    return tiny_model("qwen2", seed=seed, vocab_size=VOCAB)  # tied embeddings, 2 kv heads


def lm_rows(n: int, seed: int) -> list[dict]:
    """Random token rows; the labels mask a random prefix, so micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, SEQ // 2, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def texts(n: int, seed: int) -> list[dict]:
    import random

    r = random.Random(seed)
    words = "tensor parallel training compresses every message to eight bits with a hadamard transform".split()
    return [{"text": " ".join(r.choice(words) for _ in range(r.randint(3, 9)))} for _ in range(n)]


def common(args, name: str, **extra) -> dict:
    per_device = BATCH * (args.dp if args.reference else 1)  # one process: the global batches
    sizes = {}
    if args.sizes and not args.reference:  # the Trainer's own way to give them (torchrun: no launch config)
        from accelerate import ParallelismConfig

        sizes["parallelism_config"] = ParallelismConfig(**{f"{k}_size": int(v) for k, v in
                                                           (kv.split("=") for kv in args.sizes.split(","))})
    return {**dict(output_dir=os.path.join(args.dir, name), per_device_train_batch_size=per_device,
                   per_device_eval_batch_size=per_device, gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=3e-3,
                   lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1,
                   report_to=[], seed=7, save_strategy="no", disable_tqdm=True, bf16=False), **sizes, **extra}


def history(trainer) -> dict:
    """The logged figures per optimizer step (rank 0's log_history) and the last evaluation."""
    logs = trainer.state.log_history
    steps = [h for h in logs if "loss" in h]
    comm = [h for h in logs if "comm/bytes_sent" in h]
    return {
        "losses": [h["loss"] for h in steps], "grad_norms": [h["grad_norm"] for h in steps],
        "lrs": [h["learning_rate"] for h in steps], "steps": [h["step"] for h in steps],
        "token_accuracy": [h.get("mean_token_accuracy") for h in steps],
        "num_tokens": [h.get("num_tokens") for h in steps],
        "input_tokens": [h.get("num_input_tokens_seen") for h in steps],
        "bytes_sent": sum(h["comm/bytes_sent"] for h in comm), "bytes_saved": sum(h["comm/bytes_saved"] for h in comm),
        "comm_logged": len(comm), "evals": [h["eval_loss"] for h in logs if "eval_loss" in h],
        "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
    }


def trainer_class(args, cls, compression=None):
    """The plain class (reference), or taco_trainer's: compression off unless asked (never
    "auto", whose timing decision depends on the machine's load)."""
    if args.reference:
        return cls
    import taco_accel

    return taco_accel.taco_trainer(cls, compression=compression)


def top1_and_logsumexp(logits, labels):
    """What the metrics keep of the logits: the argmax, and the log-sum-exp over the vocabulary
    (a vocabulary slice instead of the full logits changes both)."""
    return logits.argmax(-1), logits.logsumexp(-1)


def metrics(pred) -> dict:
    top1, logsumexp = pred.predictions[0][:, :-1], pred.predictions[1][:, :-1]
    labels = pred.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((top1[mask] == labels[mask]).mean()), "logsumexp": float(logsumexp[mask].mean())}


def run_trainer(args, name: str, compression=None, resume: str | None = None, seed: int = 0, loss_func=None,
                **precision) -> dict:
    """``precision``: TrainingArguments' precision flags (bf16=True, use_cpu=True: transformers asks
    for use_cpu with bf16 on a machine without a bf16 GPU) or other settings; the default, fp32.
    ``loss_func``: the Trainer's ``compute_loss_func``."""
    from transformers import Trainer, TrainingArguments

    save, full = dict(precision), resume is None and compression is None and not precision and loss_func is None
    if full:  # checkpoints every 2 steps; the better of the two at the end
        save = dict(save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                    load_best_model_at_end=True, metric_for_best_model="eval_loss")
    cls = trainer_class(args, Trainer, compression=compression)
    logits_seen = LogitsSeen()
    settings = common(args, name, include_num_input_tokens_seen="all", **save)
    trainer = cls(model=tiny(seed), args=TrainingArguments(**settings),
                  train_dataset=lm_rows(STEPS * BATCH * ACCUM * args.dp, 1), eval_dataset=lm_rows(EVAL, 2),
                  compute_metrics=metrics, preprocess_logits_for_metrics=top1_and_logsumexp, callbacks=[logits_seen],
                  compute_loss_func=loss_func)
    trainer.train(resume_from_checkpoint=resume)
    out = history(trainer)
    out["logits_seen"] = sorted(set(logits_seen.seen))
    out["scaler"] = type(trainer.accelerator.scaler).__name__
    if full:
        out["eval"] = trainer.evaluate()
        final = os.path.join(args.dir, name, "final")
        trainer.save_model(final)
        out["loaded_eval_loss"] = loaded_eval_loss(final) if int(os.environ.get("RANK", "0")) == 0 else None
        pc = trainer.accelerator.parallelism_config
        out["layout"] = {"tp_size": trainer.get_tp_size(), "total_batch": trainer.get_total_train_batch_size(trainer.args),
                         "config": None if pc is None else [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size],
                         "num_processes": trainer.accelerator.num_processes,
                         "world_size": trainer.accelerator.state.num_processes}
    return out


def run_wire(args) -> dict:
    """taco_trainer(Trainer), compressed, whose collectives meet a chunk of another config at
    optimizer step 2 (rank 1 changes a forward site's format: the wire size stays; the header
    reads deferred as on a GPU, `codec.api.READ_AT_ONCE` emptied as TACO_DEFER_HEADER_READS=1
    does), logging only after the run: every rank's error, and the step it came at."""
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import taco_accel
    from taco_accel.codec import api

    class Drift(TrainerCallback):
        def on_step_begin(self, targs, state, control, model=None, **kwargs):
            if state.global_step == 2 and dist.get_rank() == 1:
                site = taco_accel.models.context_of(model).sites["layers.0.mlp.down_proj/fwd"]
                site.config = site.config.replace(format="e5m2")

    cls = trainer_class(args, Trainer, compression=taco_accel.TacoConfig(group_size=32))
    settings = common(args, "wire", logging_steps=STEPS + 1)  # no log, and so no statistics' pop, in the run
    trainer = cls(model=tiny(), args=TrainingArguments(**settings), train_dataset=lm_rows(STEPS * BATCH * ACCUM * args.dp, 1),
                  callbacks=[Drift()])
    saved, api.READ_AT_ONCE = api.READ_AT_ONCE, ()
    try:
        trainer.train()
        mine = {"type": None, "message": None}
    except Exception as error:  # noqa: BLE001 - the outcome is what the test reads
        mine = {"type": type(error).__name__, "message": str(error)}
    finally:
        api.READ_AT_ONCE = saved
    mine["step"] = trainer.state.global_step
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every}


def LogitsSeen():
    """A TrainerCallback that records, per forward of the trained model, (training, has logits)."""
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            record = lambda m, a, out: self.seen.append((m.training, getattr(out, "logits", None) is not None))  # noqa: E731
            model.register_forward_hook(record)

    return Seen()


def run_checkpointed(args) -> dict:
    """The Trainer with activation checkpointing (TrainingArguments' own flag, under the name this
    transformers has: activation_checkpointing from 5.20, gradient_checkpointing before)."""
    from transformers import TrainingArguments

    names = TrainingArguments.__dataclass_fields__
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return run_trainer(args, "checkpointed", **{flag: True})


def run_unaveraged(args) -> dict:
    """The Trainer with ``average_tokens_across_devices=False`` (each process normalises the loss by
    its own token count: at tp=2 that of the one batch its replica reads), evaluated at steps 2 and 4."""
    return run_trainer(args, "unaveraged", average_tokens_across_devices=False, eval_strategy="steps", eval_steps=2)


def z_loss_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A user's loss (the Trainer's ``compute_loss_func``), computed from the full logits: the
    cross-entropy of each scored token plus 1e-2 x its squared log-partition (PaLM's z-loss), summed
    and divided by ``num_items_in_batch`` (the Trainer's token count)."""
    logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
    scored = targets != -100
    lse = logits.logsumexp(-1)
    nll = lse - logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    total = ((nll + 1e-2 * lse**2) * scored).sum()
    return total / (scored.sum() if num_items_in_batch is None else num_items_in_batch)


def run_liger(args) -> dict:
    """taco_trainer(Trainer) with use_liger_kernel=True: refused when the Trainer is built."""
    from transformers import Trainer, TrainingArguments

    try:
        trainer_class(args, Trainer)(model=tiny(), args=TrainingArguments(**common(args, "liger", use_liger_kernel=True)),
                                     train_dataset=lm_rows(4, 1))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def loaded_eval_loss(folder: str) -> float:
    """The evaluation loss of what save_model wrote, loaded by transformers on this one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = lm_rows(EVAL, 2)
    ids, labels = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss.item()


def run_plain_checkpoint(args) -> dict:
    """Resume from a checkpoint as one process writes it (optimizer.pt, no sharded state): refused."""
    import shutil

    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    folder = os.path.join(args.dir, "plain", "checkpoint-2")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(args.dir, "trainer", "checkpoint-2"), folder)
        shutil.rmtree(os.path.join(folder, "taco_state"))
        torch.save({}, os.path.join(folder, "optimizer.pt"))
    dist.barrier()
    trainer = trainer_class(args, Trainer)(model=tiny(), args=TrainingArguments(**common(args, "plain")),
                                           train_dataset=lm_rows(STEPS * BATCH * ACCUM * args.dp, 1))
    try:
        trainer.train(resume_from_checkpoint=folder)
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        return {"refused": f"{type(e).__name__}: {e}"}
    return {"refused": None}


def run_patched(args) -> dict:
    """A plain Trainer with transformers.trainer.Accelerator replaced by taco_accel.Accelerator (a
    workaround a user may try): refused on every rank, naming taco_trainer."""
    import torch.distributed as dist
    import transformers.trainer as trainer_module
    from transformers import Trainer, TrainingArguments

    import taco_accel

    built, trainer_module.Accelerator = trainer_module.Accelerator, taco_accel.Accelerator
    try:
        Trainer(model=tiny(), args=TrainingArguments(**common(args, "patched")), train_dataset=lm_rows(8, 1))
        message = None
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        message = f"{type(e).__name__}: {e}"
    finally:
        trainer_module.Accelerator = built
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    return {"refused": message, "every_rank": every}


def run_pipeline_sizes(args) -> dict:
    """tp=2 on 4 processes: sizes that leave processes over are refused (Accelerate's rule), and
    pipeline stages asked for (TACO_PP_SIZE=2), which the Trainer cannot run, are refused too."""
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments, Trainer

    def refusal(**env) -> str | None:
        sizes = ParallelismConfig(tp_size=2, dp_replicate_size=1, dp_shard_size=1, cp_size=1, sp_size=1)  # not the launch's
        config = TrainingArguments(**{**common(args, "pipeline"), "parallelism_config": sizes})
        os.environ.update(env)
        try:
            trainer_class(args, Trainer)(model=tiny(), args=config, train_dataset=lm_rows(8, 1))
        except ValueError as e:
            return str(e)
        finally:
            for key in env:
                os.environ.pop(key)
        return None

    return {"refused": refusal(), "refused_pp": refusal(TACO_PP_SIZE="2")}


def prompt_completions(n: int, seed: int) -> list[dict]:
    return [{"prompt": row["prompt"], "completion": row["chosen"]} for row in preferences(n, seed)]


def conversations(n: int, seed: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["chosen"]}]}
            for row in preferences(n, seed)]


# a chat template that marks the assistant's tokens ({% generation %}: SFTConfig(assistant_only_loss=True))
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                 "<|endoftext|>{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")


def run_sft_settings(args, name: str, data: str, **settings) -> dict:
    """SFTTrainer with the settings that choose which tokens it scores and how it batches them:
    ``data="completions"`` (prompt-completion rows: completion_only_loss by default), ``"chat"``
    (conversations under `CHAT_TEMPLATE`). ``settings``: SFTConfig's."""
    from trl import SFTConfig, SFTTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("byte")
    tokenizer.chat_template = CHAT_TEMPLATE
    rows = STEPS * BATCH * ACCUM * args.dp * (4 if settings.get("packing") else 1)  # packing joins about 4 rows
    dataset = prompt_completions(rows, 7) if data == "completions" else conversations(rows, 8)
    config = SFTConfig(**common(args, name, max_length=48, **settings), eval_strategy="no", dataset_num_proc=None)
    trainer = trainer_class(args, SFTTrainer)(model=tiny(), args=config, processing_class=tokenizer,
                                              train_dataset=_dataset(dataset))
    trainer.train()
    return history(trainer)


def run_sft(args, name: str, lora: bool = False, bf16: bool = False) -> dict:
    """``bf16``: SFTConfig's own precision default (bf16=True), use_cpu=True as transformers asks on CPU."""
    from trl import SFTConfig, SFTTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    peft = {}
    if lora:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    # TRL's evaluation loss and entropy are each batch's own token means, averaged over batches: the
    # reference evaluates the batches of one replica (BATCH rows), the sharded run's batches
    settings = common(args, name, max_length=48, per_device_eval_batch_size=BATCH,
                      include_num_input_tokens_seen="non_padding")
    if bf16:
        del settings["bf16"]
        settings["use_cpu"] = True
    config = SFTConfig(**settings, eval_strategy="no", dataset_num_proc=None)
    assert config.bf16 == bf16
    trainer = trainer_class(args, SFTTrainer)(
        model=tiny(), args=config, processing_class=build_tokenizer("byte"),
        train_dataset=_dataset(texts(STEPS * BATCH * ACCUM * args.dp, 3)), eval_dataset=_dataset(texts(EVAL, 4)), **peft)
    trainer.train()
    out = history(trainer)
    out["eval"] = trainer.evaluate()
    if args.reference and args.dp > 1:  # its token accuracy is one ratio per step over the gathered
        # batches of every replica: on one process, that is the global batch of BATCH * dp rows
        trainer.args.per_device_eval_batch_size = BATCH * args.dp
        out["eval"]["eval_mean_token_accuracy"] = trainer.evaluate()["eval_mean_token_accuracy"]
    trainer.save_model(os.path.join(args.dir, name, "final"))
    return out


def preferences(n: int, seed: int) -> list[dict]:
    import random

    r = random.Random(seed)
    words = "tensor parallel training compresses every message to eight bits with a hadamard transform".split()
    say = lambda: " ".join(r.choice(words) for _ in range(r.randint(2, 6)))  # noqa: E731
    return [{"prompt": say(), "chosen": say(), "rejected": say()} for _ in range(n)]


def saved_tiny(args) -> str:
    """The tiny model's checkpoint under DIR, written once (rank 0): a policy loaded from it has a
    path TRL can build its reference model from."""
    import torch.distributed as dist

    path = os.path.join(args.dir, "dpo_base")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(path):
        tiny().save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def run_dpo(args, name: str, ref: str, compression=None, **settings) -> dict:
    """TRL's DPOTrainer: ``ref="passed"`` (a reference model given), ``"path"`` (TRL builds it from
    the policy's local checkpoint and prepares it with prepare_model(evaluation_mode=True)),
    ``"lora"`` (a LoRA policy: the reference is the adapter switched off)."""
    from trl import DPOConfig, DPOTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    path = saved_tiny(args)
    from transformers import AutoModelForCausalLM

    extra = {}
    if ref == "passed":
        extra["ref_model"] = AutoModelForCausalLM.from_pretrained(path)
    if ref == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "v_proj", "down_proj"])
    # SGD: at step 1 the policy is its reference and many gradient entries cancel to rounding noise,
    # whose sign Adam's first step would turn into full steps of lr (another sum order, another sign)
    # max_length 64: longer than every prompt (at most 50 bytes here), so TRL's keep_start truncation
    # cuts completions but drops no example; a dropped one leaves a short last batch, which one
    # process trains as it is while Accelerate's even_batches fills a dp replica's with repeated rows
    config = DPOConfig(**common(args, name, max_length=64, beta=0.5, max_steps=2, optim="sgd", learning_rate=0.05,
                                **settings), dataset_num_proc=None)
    rows = 2 * BATCH * ACCUM * args.dp  # two full global batches
    trainer = trainer_class(args, DPOTrainer, compression=compression)(
        model=AutoModelForCausalLM.from_pretrained(path), args=config, processing_class=build_tokenizer("byte"),
        train_dataset=_dataset(preferences(rows, 5)), **extra)
    if len(trainer.train_dataset) != rows:
        raise ValueError(f"TRL kept {len(trainer.train_dataset)} of {rows} preference rows (fully truncated "
                         "prompts dropped): raise max_length above the longest prompt")
    trainer.train()
    out = history(trainer)
    out["rewards"] = [[h.get("rewards/chosen"), h.get("rewards/rejected")] for h in trainer.state.log_history
                      if "loss" in h]
    return out


DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # TRL 1.16's
PROMPTS = ("tensor parallel", "compress every message", "a hadamard transform", "eight bits with")
GENERATIONS = 4  # completions per prompt


def vowel_share(completions, **kwargs) -> list[float]:
    """A reward that is a function of the completion's text: its share of vowels."""
    return [sum(map(c.count, "aeiou")) / max(len(c), 1) for c in completions]


def letter_share(completions, **kwargs) -> list[float]:
    """A second reward: the completion's share of ASCII letters."""
    return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def run_online(args, name: str, trainer: str = "GRPO", reward_funcs=vowel_share, steps: int = 2, **settings) -> dict:
    """TRL's GRPOTrainer or RLOOTrainer: 4 prompts x 4 completions sampled by the model (8 tokens at
    most) per optimizer step, in 2 micro-batches of 8 rows (steps_per_generation 2: one generation
    serves the step), 2 SGD steps. ``use_cpu=True``: TRL's config then counts every process, as it
    does on GPUs (without it a CPU process sees a world of 1). The policy is loaded from a path, from
    which TRL builds the reference model where ``beta`` asks for one. ``settings``: the config's."""
    import trl
    from transformers import AutoModelForCausalLM

    from taco_accel.data.tokenizer import build_tokenizer

    per_device = GENERATIONS * len(PROMPTS) // ACCUM * (args.dp if args.reference else 1)
    config = getattr(trl, f"{trainer}Config")(**common(
        args, name, per_device_train_batch_size=per_device, max_steps=steps, optim="sgd", learning_rate=0.05, use_cpu=True,
        num_generations=GENERATIONS, max_completion_length=8, **settings))
    cls = trainer_class(args, getattr(trl, f"{trainer}Trainer"))
    model = AutoModelForCausalLM.from_pretrained(saved_tiny(args))
    online = cls(model=model, args=config, processing_class=build_tokenizer("byte"), reward_funcs=reward_funcs,
                 train_dataset=_dataset([{"prompt": p} for p in PROMPTS * 4]))
    online.train()
    logged = [h for h in online.state.log_history if "loss" in h]
    return {**history(online), "rewards": [h.get("reward") for h in logged], "entropy": [h.get("entropy") for h in logged],
            "completions": list(online._logs["completion"]), "generation_batch_size": online.args.generation_batch_size}


# GRPO's loss types beside its default (dapo, in "grpo") and bnpo ("grpo_ref"), with the settings
# each takes: Dr. GRPO unscaled rewards, LUSPO sequence-level ratios; truncated completions masked
GRPO_LOSSES = {"grpo": {}, "dr_grpo": {"scale_rewards": "none"}, "cispo": {"mask_truncated_completions": True},
               "sapo": {}, "vespo": {}, "luspo": {"importance_sampling_level": "sequence"}}


def run_online_losses(args) -> dict:
    """GRPOTrainer with each loss type of `GRPO_LOSSES`, one optimizer step (what differs between
    them is the loss's normaliser, which the first gradient shows): ``{loss type: run_online's figures}``."""
    return {loss: run_online(args, f"grpo_{loss}", steps=1, loss_type=loss, **settings)
            for loss, settings in GRPO_LOSSES.items()}


def run_kto(args) -> dict:
    """TRL's KTOTrainer: unpaired completions labelled desirable or not, the reference model built by
    TRL from the policy's path, its KL term from completions rotated within each batch (per_device_train_batch_size
    rows: one process and the tp ranks of one replica rotate the same rows), 2 SGD steps."""
    import random

    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    r = random.Random(6)
    rows = [{**row, "label": r.random() < 0.5} for row in preferences(2 * BATCH * ACCUM, 6)]
    data = [{"prompt": row["prompt"], "completion": row["chosen"], "label": row["label"]} for row in rows]
    config = KTOConfig(**common(args, "kto", max_steps=2, optim="sgd", learning_rate=0.05, max_length=64),
                       dataset_num_proc=None)
    trainer = trainer_class(args, KTOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(saved_tiny(args)), args=config,
        processing_class=build_tokenizer("byte"), train_dataset=_dataset(data))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {**history(trainer), "kl": [h.get("kl") for h in logged]}


def run_online_refusals(args) -> dict:
    """Each setting refused at tp > 1: the message each construction raised. GRPOTrainer with a
    generation back end with weights of its own, and with a generation of 2 per device x 1 replica,
    not whole groups of 4 (TRL counts 2 x 2 processes, which are); the Trainer with NEFTune; DPO
    with precomputed reference log-probabilities."""
    import trl
    from transformers import Trainer, TrainingArguments

    from taco_accel.data.tokenizer import build_tokenizer

    def grpo(**settings):
        config = trl.GRPOConfig(**common(args, "refused", **{"per_device_train_batch_size": 8, "use_cpu": True,
                                                             "num_generations": 4, "max_completion_length": 8,
                                                             **settings}))
        trainer_class(args, trl.GRPOTrainer)(model=tiny(), args=config, processing_class=build_tokenizer("byte"),
                                             reward_funcs=vowel_share, train_dataset=_dataset([{"prompt": "a"}] * 8))

    def neftune():
        trainer_class(args, Trainer)(model=tiny(), args=TrainingArguments(**common(args, "refused", neftune_noise_alpha=5.0)),
                                     train_dataset=lm_rows(8, 1))

    def precompute():
        config = trl.DPOConfig(**common(args, "refused", max_length=64, precompute_ref_log_probs=True),
                               dataset_num_proc=None)
        trainer_class(args, trl.DPOTrainer)(model=tiny(), ref_model=tiny(), args=config,
                                            processing_class=build_tokenizer("byte"), train_dataset=_dataset(preferences(8, 5)))

    refused = {}
    for name, build in (("use_transformers_continuous_batching", lambda: grpo(use_transformers_continuous_batching=True)),
                        ("generation_batch_size", lambda: grpo(per_device_train_batch_size=2, gradient_accumulation_steps=1)),
                        ("neftune_noise_alpha", neftune), ("precompute_ref_log_probs", precompute)):
        try:
            build()
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    return {"refused": refused}


def _dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--runs", default="trainer,resume,compressed,sft,lora,plain_checkpoint")
    p.add_argument("--sizes", default="", help="TrainingArguments.parallelism_config sizes, e.g. tp=2,dp_replicate=2")
    p.add_argument("--reference", default="", help="the plain classes on one process, for these dp sizes (1,2)")
    args = p.parse_args()
    import taco_accel

    runs = {
        "trainer": lambda: run_trainer(args, "trainer"),
        # other initial weights: what the resumed run trains comes from the checkpoint
        "resume": lambda: run_trainer(args, "resume", resume=os.path.join(args.dir, "trainer", "checkpoint-2"), seed=1),
        "compressed": lambda: run_trainer(args, "compressed", compression=taco_accel.TacoConfig(group_size=32)),
        "sft": lambda: run_sft(args, "sft"),
        "lora": lambda: run_sft(args, "lora", lora=True),
        "plain_checkpoint": lambda: run_plain_checkpoint(args),
        "pipeline_sizes": lambda: run_pipeline_sizes(args),
        "patched": lambda: run_patched(args),
        "checkpointed": lambda: run_checkpointed(args),
        "liger": lambda: run_liger(args),
        "unaveraged": lambda: run_unaveraged(args),
        # settings that change the loss: label smoothing; a user's loss function
        "smoothed": lambda: run_trainer(args, "smoothed", label_smoothing_factor=0.1),
        "loss_func": lambda: run_trainer(args, "loss_func", loss_func=z_loss_cross_entropy),
        # completion_only_loss (prompt-completion rows), packing (padding_free: position_ids), the DFT loss
        "sft_settings": lambda: run_sft_settings(args, "sft_settings", "completions", packing=True, loss_type="dft"),
        "sft_assistant": lambda: run_sft_settings(args, "sft_assistant", "chat", assistant_only_loss=True),
        # two weighted losses, WPO's weighting (log_sum_sq_probs of the fused head) and LD-DPO's weighting
        # of the tokens past the shorter completion
        "dpo_variants": lambda: run_dpo(args, "dpo_variants", ref="passed", loss_type=["sigmoid", "ipo"],
                                        loss_weights=[1.0, 0.5], use_weighting=True, ld_alpha=0.5),
        # TR-DPO: the reference mixed with the policy after every step; a Jensen-Shannon divergence
        "dpo_sync": lambda: run_dpo(args, "dpo_sync", ref="passed", sync_ref_model=True, ref_model_mixup_alpha=0.5,
                                    ref_model_sync_steps=1, f_divergence_type="js_divergence"),
        # every DPO loss type, summed (robust and exo_pair take label smoothing)
        "dpo_losses": lambda: run_dpo(args, "dpo_losses", ref="passed", loss_type=list(DPO_LOSSES), label_smoothing=0.1),
        "grpo_losses": lambda: run_online_losses(args),
        "grpo": lambda: run_online(args, "grpo"),
        # a reference model (beta), several passes over each generation: importance ratios from the old log-probs
        "grpo_ref": lambda: run_online(args, "grpo_ref", beta=0.04, loss_type="bnpo", num_iterations=2,
                                       scale_rewards="batch", top_entropy_quantile=0.5),
        # two rewards, each normalised over the batch (statistics over the rows of every replica, each once)
        "grpo_multi": lambda: run_online(args, "grpo_multi", multi_objective_aggregation="normalize_then_sum",
                                         reward_funcs=[vowel_share, letter_share], reward_weights=[1.0, 0.5]),
        # RLOO's KL term (beta 0.05 by default) gathered with the rewards; advantages normalised over the batch
        "rloo": lambda: run_online(args, "rloo", "RLOO", normalize_advantages=True),
        "kto": lambda: run_kto(args),
        "online_refusals": lambda: run_online_refusals(args),
        "wire": lambda: run_wire(args),
        "dpo": lambda: run_dpo(args, "dpo", ref="passed"),
        "dpo_path": lambda: run_dpo(args, "dpo_path", ref="path"),
        "dpo_lora": lambda: run_dpo(args, "dpo_lora", ref="lora"),
        "dpo_compressed": lambda: run_dpo(args, "dpo_compressed", ref="passed",
                                          compression=taco_accel.TacoConfig(group_size=32)),
    }
    if args.reference:  # compressed and resumed runs compare with the reference "trainer" run
        result, base = {}, args.dir
        for dp in map(int, args.reference.split(",")):
            args.dp, args.dir = dp, os.path.join(base, f"dp{dp}")
            result[f"dp{dp}"] = guarded(runs, ["trainer", "sft"] + (["lora", "dpo", "dpo_lora", "grpo", "grpo_ref",
                                                                      "grpo_multi", "rloo", "kto", *SETTINGS] if dp == 1 else ["dpo"]))
    else:
        args.dp = int(os.environ["WORLD_SIZE"]) // 2  # tp=2 in every launch of the test
        result = guarded(runs, args.runs.split(","))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, default=str)


# the settings runs, each against one process at tp=2 (tests/test_hf_trainer.py: docs/settings.md's rows)
SETTINGS = ["smoothed", "loss_func", "sft_settings", "sft_assistant", "dpo_variants", "dpo_sync", "dpo_losses",
            "grpo_losses"]


def guarded(runs: dict, names: list[str]) -> dict:
    """Each run's figures, or its traceback: one failing run does not hide the others."""
    result = {}
    for name in names:
        start = time.perf_counter()
        try:
            result[name] = {**runs[name](), "seconds": time.perf_counter() - start}
        except Exception:  # noqa: BLE001 - recorded for the test of this run
            result[name] = {"error": traceback.format_exc()}
    return result


if __name__ == "__main__":
    main()
