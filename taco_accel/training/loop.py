"""The one training loop: steps, evaluation, logging, progress, checkpoints, the end of a run.

`TrainingLoop.train` is what every run of the recipes does, pretraining (`Trainer`) and
fine-tuning (`Finetuner`) alike; a subclass says what one step is (``train_step() -> row``),
how it evaluates (``evaluate() -> metrics``), how a log line reads (``format_row``) and what
the end of a run writes (``finish``). The loop owns the order::

    before_training()                       # e.g. a baseline evaluation at step 0
    while step < until:
        row = train_step()                  # the step counter advances
        row |= evaluate()                   # every eval_every steps, and after the last step
        log to the trackers, the bar, every log_every steps a line
        save_state(checkpoints/step_N)      # every save_every steps
        if should_stop(row): return         # a time budget, a diverged loss: as if preempted
    history.jsonl, compression.json; finish()  # only when the last step ran (not a preempted stop)

A run that starts at step 0 refuses an output folder that holds a previous run's
``history.jsonl`` or checkpoints (`check_output_folder`): continue that run with
``--resume latest``, or choose another folder. A checkpoint holds the run's tokenizer identity
too: resuming with another tokenizer (even one of the same vocabulary size) is refused.

A subclass sets ``cfg`` (``steps``, ``eval_every``, ``log_every``, ``save_every``, ``progress``,
``output_dir`` and the `HPARAMS`), ``accelerator``, ``out`` (the output folder; None: the run
writes no file), ``trackers``, ``is_main``, ``step``, ``history``, ``optimizer`` and
``scheduler``, and registers itself with ``accelerator.register_for_checkpointing``: a checkpoint
then holds the step, the history and the hyper-parameters, and a resume with changed ones
applies them with a warning. The pretraining `Trainer` (and through it the convergence study's
runs, `taco_accel.bench.convergence`) and the `Finetuner` are the subclasses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import torch.distributed as dist

from ..errors import CheckpointError, OutputExistsError
from ..integrations import checkpoint
from .metrics import write_history, write_json

logger = logging.getLogger(__name__)

# what a resumed run may change: it applies from the resumed step on (`TrainingLoop.apply_hparams`)
HPARAMS = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "steps")


class TrainingLoop:
    """Base of the run classes; see the module doc."""

    run_name = "run"

    def train_step(self) -> dict:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def format_row(self, row: dict) -> str:
        raise NotImplementedError

    def before_training(self) -> None:
        """Hook before the first step of a run (not of a resumed one)."""

    def finish(self) -> None:
        """Hook after the last step: histories, plots, exports."""

    def should_stop(self, row: dict) -> bool:
        """Hook after each step's row (with its evaluation): True ends the run there, as a
        preempted job (no `finish`): a time budget, a diverged loss."""
        return False

    # -- checkpoints: the loop's own state (register the loop with register_for_checkpointing) ---
    def state_dict(self) -> dict:
        cfg = self.cfg
        return {"step": self.step, "history": self.history, "hparams": {k: getattr(cfg, k) for k in HPARAMS},
                "tokenizer": self.tokenizer_identity(), **self.extra_state()}

    def load_state_dict(self, state: dict) -> None:
        """Step and history from the checkpoint; changed hyper-parameters win, with a warning
        (`apply_hparams`); another tokenizer than the checkpoint's raises a `CheckpointError`."""
        saved, mine = state.get("tokenizer"), self.tokenizer_identity()
        if saved is not None and mine is not None and saved["digest"] != mine["digest"]:
            raise CheckpointError(
                f"the checkpoint was trained with the tokenizer {saved['name']!r} ({saved['size']} tokens, "
                f"fingerprint {saved['digest'][:12]}), this run has {mine['name']!r} ({mine['size']} tokens, "
                f"{mine['digest'][:12]}): the token ids would mean other text. Resume with --tokenizer "
                f"{saved['name']}, or start a new run in another --output-dir"
            )
        self.step, self.history = state["step"], state["history"]
        self.load_extra_state(state)
        changed = {k: (v, getattr(self.cfg, k)) for k, v in state["hparams"].items() if getattr(self.cfg, k) != v}
        if changed:
            if self.is_main:
                logger.warning("resuming at step %d with changed settings (checkpoint -> now): %s; the new values "
                               "apply from here", self.step, ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
            self.apply_hparams()

    def extra_state(self) -> dict:
        return {}

    def tokenizer_identity(self) -> dict | None:
        """``{"name", "size", "digest"}`` of the run's tokenizer (``self.tokenizer``), or None."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            return None
        from ..data.tokenizer import tokenizer_digest

        name = getattr(self.cfg, "tokenizer", None) or getattr(tokenizer, "name_or_path", "") or "?"
        return {"name": str(name), "size": len(tokenizer), "digest": tokenizer_digest(tokenizer)}

    def check_output_folder(self) -> None:
        """An `OutputExistsError` on every rank if this run starts at step 0 in an output folder
        that holds a previous run's ``history.jsonl`` or checkpoints (it would overwrite them, or
        a later ``--resume latest`` would mix the two runs)."""
        if self.out is None or self.step != 0:
            return
        problem = None
        if self.is_main:
            found = [str(p) for p in (self.out / "history.jsonl",) if p.exists()]
            if checkpoint.exists(self.out / "checkpoints"):
                found.append(str(self.out / "checkpoints"))
            if found:
                problem = (f"the output folder {self.out} holds a previous run ({', '.join(found)}): continue it "
                           "with --resume latest, or start this one in another --output-dir (or delete those)")
        if dist.is_initialized():
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            raise OutputExistsError(problem)

    def load_extra_state(self, state: dict) -> None:
        """Hook: the subclass's part of `state_dict`."""

    def apply_hparams(self) -> None:
        """Re-apply ``cfg``'s learning rate and weight decay to the optimizer and its schedule at
        the current step (``optimizer`` param groups: decay, then no decay; ``scheduler``: an
        Accelerate-wrapped LambdaLR of ``lr_factor``); warm-up and length are read from ``cfg``
        by the schedule itself."""
        cfg, scheduler = self.cfg, self.scheduler.scheduler
        factor = self.lr_factor(scheduler.last_epoch)
        scheduler.base_lrs = [cfg.lr for _ in scheduler.base_lrs]
        for group, decay in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0)):
            group["initial_lr"], group["lr"], group["weight_decay"] = cfg.lr, cfg.lr * factor, decay
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def lr_factor(self, step: int) -> float:
        return lr_lambda(self.cfg)(step)

    def train(self, until: int | None = None) -> list[dict]:
        """Train to ``cfg.steps`` (or stop after step ``until``, as a preempted job would: no
        `finish` then); returns the metric history. Evaluation runs every ``eval_every`` steps
        (0: never in between) and after the last step."""
        cfg, acc = self.cfg, self.accelerator
        until = cfg.steps if until is None else min(until, cfg.steps)
        self.check_output_folder()
        if self.is_main and self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1, default=str))
        if self.is_main and self.trackers:
            acc.init_trackers(Path(cfg.output_dir).name or self.run_name, config=flat(cfg.to_dict()))
        if self.step == 0:
            self.before_training()
        with progress_bar(cfg.steps, self.step, enabled=cfg.progress and self.is_main) as bar:
            while self.step < until:
                row = self.train_step()
                if self.step == cfg.steps or (cfg.eval_every and self.step % cfg.eval_every == 0):
                    row.update(self.evaluate())
                self.history.append(row)
                if self.is_main:
                    acc.log({k: v for k, v in row.items() if k != "step"}, step=self.step)
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.3f}")
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                        logger.info(self.format_row(row))
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
                if self.should_stop(row):
                    return self.history
        if self.step == cfg.steps:
            if self.out is not None:
                decisions = acc.compression_decisions()  # a collective
                if self.is_main:
                    write_history(self.history, self.out / "history.jsonl")
                    write_json(decisions, self.out / "compression.json")  # what each site did, and why
            self.finish()
            if self.is_main and self.trackers:
                acc.end_training()
        return self.history

    def save_checkpoint(self) -> Path:
        """``OUTPUT_DIR/checkpoints/step_<N>`` through ``accelerator.save_state`` (a collective)."""
        return self.accelerator.save_state(self.out / "checkpoints" / f"step_{self.step}")

    def resume(self, where: str) -> None:
        """Continue from ``where``: ``"latest"`` (the newest undamaged checkpoint under
        ``OUTPUT_DIR/checkpoints``; none: start from scratch) or a checkpoint folder."""
        root = self.out / "checkpoints"
        folder = checkpoint.latest(root) if where == "latest" else Path(where)
        if folder is None:
            logger.info("no checkpoint under %s: starting from scratch", root)
            return
        self.accelerator.load_state(folder)

    @staticmethod
    def format_head(row: dict) -> str:
        """The start of every loop's log line: step, loss, learning rate, gradient norm."""
        return f"step {row['step']}: loss {row['loss']:.4f} lr {row['lr']:.2e} grad_norm {row['grad_norm']:.3f}"


TRAFFIC_KINDS = ("tp", "pp", "dp")


def traffic_kind(site: str) -> str:
    """The kind of traffic a site moves, from its name: ``pp`` (``pp.<...>``: pipeline stage
    boundaries), ``dp`` (``dp.<...>``: data-parallel gradients), else ``tp``."""
    head = site.split(".", 1)[0]
    return head if head in ("pp", "dp") else "tp"


def comm_totals(ledgers) -> list[float]:
    """Bytes sent and bytes a plain collective would send by this rank's sites of one model (its
    ``ledgers``: `ModelParts.ledgers`, `Accelerator.comm_ledgers`) since the last call, per kind of traffic
    (`traffic_kind`): ``[tp sent, tp plain, pp sent, pp plain, dp sent, dp plain]`` (a step's
    figures; the loops sum them over the ranks with their loss, then `comm_fields`)."""
    from ..comm.stats import pop_ledgers

    out = [0.0] * (2 * len(TRAFFIC_KINDS))
    # the wire-header flags are the optimizer step's to read (`Accelerator.read_with_wire_check`)
    for name, s in pop_ledgers(ledgers, check=False).items():
        k = 2 * TRAFFIC_KINDS.index(traffic_kind(name))
        out[k] += s.bytes_sent
        out[k + 1] += s.bytes_uncompressed
    return out


def comm_fields(totals) -> dict:
    """A history row's communication fields from `comm_totals`' numbers (summed over ranks):
    ``comm_bytes_sent``, ``comm_bytes_saved`` and ``comm_compression`` (plain / sent) over every
    kind, and ``comm_<kind>_bytes_sent`` / ``comm_<kind>_bytes_saved`` per kind."""
    sent, plain = sum(totals[0::2]), sum(totals[1::2])
    row = {"comm_bytes_sent": sent, "comm_bytes_saved": plain - sent, "comm_compression": plain / sent if sent else 1.0}
    for i, kind in enumerate(TRAFFIC_KINDS):
        row[f"comm_{kind}_bytes_sent"] = totals[2 * i]
        row[f"comm_{kind}_bytes_saved"] = totals[2 * i + 1] - totals[2 * i]
    return row


def comm_text(row: dict) -> str:
    """`` comm saved X MiB (R x; tp a, dp b MiB)``: the log line's part, kinds with traffic only."""
    if not row.get("comm_bytes_sent"):
        return ""
    kinds = ", ".join(f"{kind} {row[f'comm_{kind}_bytes_saved'] / 2**20:.2f}" for kind in TRAFFIC_KINDS
                      if row.get(f"comm_{kind}_bytes_sent"))
    return f" comm saved {row['comm_bytes_saved'] / 2**20:.2f} MiB ({row['comm_compression']:.2f}x; {kinds} MiB)"


def lr_lambda(cfg):
    """Linear warm-up to ``cfg.lr`` over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio * lr`` at ``steps`` (a LambdaLR factor; it reads ``cfg`` at each call)."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config as one level of ``a.b`` keys with tracker-friendly values."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, str, bool)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class _NoBar:
    def update(self, n=1): ...
    def set_postfix(self, **kw): ...


@contextlib.contextmanager
def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on the main process; log lines are printed above it, not glued to it."""
    try:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield _NoBar()
        return
    with logging_redirect_tqdm(), tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True) as bar:
        yield bar
