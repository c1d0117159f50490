"""transformers' ``Trainer`` and its subclasses (TRL's ``SFTTrainer``, ...) with TACO tensor parallelism.

Two changed lines in a user's script::

    from taco_accel import taco_trainer                            # 1: the import
    trainer = taco_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds)  # 2: the class

Launched as before (``accelerate launch --config_file recipes/configs/cpu_tp2.yaml train.py``,
or ``--multi_gpu`` with ``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2))``):
the sizes are Accelerate's, tp innermost, dp over the processes tp leaves. `taco_trainer` returns
a subclass of the given class that changes the Trainer through its own extension points only:

- ``create_accelerator_and_postprocess``: the Trainer builds a `taco_accel.Accelerator` from
  every argument it derives from ``TrainingArguments`` (it reads the class from its module's
  ``Accelerator`` name, which is swapped for that one call): the same counts as a user's own loop
  gets, ``num_processes`` the data-parallel replicas and ``parallelism_config`` describing them
  (tp 1), ``gather`` over them, from which the Trainer's own arithmetic is right (its loss scale
  ``num_processes // tp``, its token counts gathered and divided by tp); its total train batch
  size, from ``args.world_size`` (every process), is the one count `upstream.transformers.TrainerCounts`
  gives instead. ``prepare`` makes the model tensor parallel, the DataLoaders are sharded over dp only.
- checkpoints (``save_steps``, ``resume_from_checkpoint``): the model goes through ``save_model``
  on every rank (the gathered, plain transformers checkpoint that ``from_pretrained`` loads on one
  process; transformers < 5.23 would call ``_save`` on the main process only);
  every rank's optimizer shard goes through ``Accelerator.save_state`` into ``taco_state/`` of
  the checkpoint folder, the scheduler where the Trainer keeps it; resuming reads them back with
  ``load_state``, and so does ``load_best_model_at_end``. Same mesh sizes to resume (the
  checkpoint module's rule).
- the loss: a training step of a class that keeps the Trainer's ``compute_loss`` (which reads
  ``outputs.loss`` only) runs the head and loss fused (``logits="none"``: no logits), at every tp;
  ``use_liger_kernel=True`` is refused (liger replaces the forward that computes them, and its fused
  loss needs the whole vocabulary's head).
- ``evaluate``: the model returns the full-vocabulary logits to the metrics
  (logits mode ``"full"`` during ``prediction_step``).
- ``log``: ``accelerator.compression_stats()`` (bytes sent and saved by TACO since the last log)
  joins every log line, so TensorBoard, W&B and ``state.log_history`` see them.
- TRL: a fused LM head (``trl.trainer.utils.add_fused_lm_head``, which SFT, DPO, GRPO, ... add to
  score tokens without logits) is answered by taco_accel's own forward, vocab-parallel, with TRL's
  settings (`taco_accel.models.loss`; taken over when the model is prepared, or here when taco_accel
  already holds it); a model that peft wrapped with plain LoRA layers (``SFTTrainer(peft_config=...)``,
  ``peft.get_peft_model``) gets the same adapter on tensor-parallel LoRA layers
  (`taco_accel.get_peft_model`).
- TRL's trainers: SFT, DPO, KTO, GRPO and RLOO (`upstream.trl.CHECKED_TRAINERS`, each trained
  against one process in the tests); the others are refused when the class is made. GRPO and RLOO
  generate ``per_device_train_batch_size x replicas x steps_per_generation`` completions at a time
  (their configs counted every process: `upstream.trl.generate_per_replica`) and gather rewards,
  KL terms and logs over the replicas (`_ReplicaRollouts`), so that group and batch statistics and
  each replica's slice are one process's.

Not supported (a ValueError says so): pipeline stages (the Trainer runs no pipeline schedule); at
tp > 1, TRL's generation back ends that keep a copy of the weights of their own (vLLM,
transformers' continuous batching).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.loss import head_of, install_head, logits_mode
from ..comm.policy import DEFAULT_COMPRESSION
from ..tp import Compression
from ..upstream import accelerate as upstream_accelerate
from ..upstream import transformers as upstream_transformers
from ..upstream import trl as upstream_trl
from . import replicas
from .accelerator import Accelerator
from .lora import tensor_parallel_lora

logger = logging.getLogger(__name__)

TACO_STATE = "taco_state"  # the sharded state's folder inside a Trainer checkpoint


def taco_trainer(trainer_cls: type, *, compression=DEFAULT_COMPRESSION, sequence_parallel: bool = False) -> type:
    """A subclass of ``trainer_cls`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``,
    your own) that trains with TACO tensor parallelism (see the module doc).

    Args:
        trainer_cls: the Trainer class to extend.
        compression: `taco_accel.Accelerator`'s ``compression``: anything `Compression.resolve`
            takes (``"auto"`` by default, ``"on"``, ``"off"``, a `TacoConfig`, a `Compression`,
            its dict or JSON file), resolved here.
        sequence_parallel: Megatron sequence parallelism inside TP.
    """
    upstream_transformers.check_version()
    upstream_accelerate.check_version()
    compression = Compression.resolve(compression)
    from transformers import Trainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"taco_trainer takes transformers.Trainer or a subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, _TacoTrainer):
        raise ValueError(f"{trainer_cls.__name__} already trains with taco_accel; pass the original class")
    upstream_trl.check_trainer(trainer_cls)
    upstream_transformers.check_trainer(trainer_cls)  # the private methods overridden below
    fused_loss = trainer_cls.compute_loss is Trainer.compute_loss  # TRL's and users' own may read the logits
    options = {"compression": compression, "sequence_parallel": sequence_parallel, "fused_loss": fused_loss}
    bases = (_TacoTrainer, trainer_cls) if upstream_trl.online_trainer(trainer_cls) is None else \
        (_TacoTrainer, _ReplicaRollouts, trainer_cls)
    return type(f"Taco{trainer_cls.__name__}", bases,
                {"taco_options": options, "__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})


class _TacoTrainer(upstream_transformers.TrainerCounts):
    """The methods `taco_trainer` puts in front of a Trainer class (see the module doc)."""

    taco_options: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.model is None:  # model_init: the model comes with train()
            return
        if self.accelerator.parallel_dims.world_size > 1:
            acc = self.accelerator
            self.model = self.model_wrapped = tensor_parallel_lora(self.model, acc.torch_device_mesh["tp"],
                                                                   acc.compression, acc.sequence_parallel)
        for model in (self.model, getattr(self, "ref_model", None)):  # TRL's: the reference model's fused head too
            if model is not None and head_of(model) is not None:  # laid out already: TRL added its head after
                install_head(model)

    # -- the accelerator ---------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        if getattr(self.args, "use_liger_kernel", False):
            raise ValueError("use_liger_kernel=True: liger-kernel replaces the causal LM's forward, in which taco_accel "
                             "computes the head and loss (its fused loss multiplies the whole vocabulary, which tensor "
                             "parallelism splits over the ranks); taco_trainer fuses the vocab-parallel head and loss "
                             "itself at every tp (logits='none' in training): leave use_liger_kernel off")
        _processes_on_cpu(self.args)
        accelerator_options = {k: self.taco_options[k] for k in ("compression", "sequence_parallel")}
        with upstream_transformers.building_accelerator(functools.partial(Accelerator, **accelerator_options)):
            super().create_accelerator_and_postprocess()
        dims = self.accelerator.parallel_dims
        if dims.pp > 1:
            raise ValueError(
                f"{self.accelerator.parallel_layout}: the Trainer runs no pipeline schedule; give sizes that cover "
                "every process with tp and dp (parallelism_config tp_size x dp_replicate_size or dp_shard_size), "
                "or train pipelines with taco_accel's own Trainer (recipes/)"
            )
        _refuse_at_tp(self.args, dims.tp)
        if upstream_trl.online_trainer(type(self)) is not None:
            upstream_trl.refuse_weight_copies(self.args, dims.tp)
            upstream_trl.generate_per_replica(self.args, dims.dp)

    # -- the loss -------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        """The Trainer's own, with the head and loss fused (``logits="none"``) where only the loss
        is read: training steps of a class that keeps the Trainer's ``compute_loss``."""
        if return_outputs or not self.taco_options["fused_loss"]:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        with logits_mode(self.accelerator.unwrap_model(model), "none"):
            return super().compute_loss(model, inputs, **kwargs)

    # -- evaluation and logs -----------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with logits_mode(self.accelerator.unwrap_model(model), "full"):  # the metrics see the whole vocabulary
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        logs.update(self.accelerator.compression_stats())  # a collective: every rank logs at the same points
        super().log(logs, *args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------
    def _sharded(self, model: nn.Module | None = None) -> bool:
        """Whether ``model`` (default: the Trainer's) is laid out over several processes."""
        context = getattr(self.accelerator.unwrap_model(model or self.model), "taco", None)
        return context is not None and not context.emulated and self.accelerator.parallel_dims.world_size > 1

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._sharded():
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir)  # on every rank: transformers < 5.23 calls _save on the main process only
        if self.args.push_to_hub and not _internal_call:  # the rest of the Trainer's save_model
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if not self._sharded():
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.accelerator.save_model(self.model, output_dir)  # every rank gathers; rank 0 writes (peft: the adapter)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        self.accelerator.save_state(Path(output_dir) / TACO_STATE)  # every rank's shard, atomic
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not self._sharded(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # already laid out: its shards come with the sharded state (_load_optimizer_and_scheduler)
        if not (Path(resume_from_checkpoint) / TACO_STATE).is_dir():
            raise CheckpointError(
                f"{resume_from_checkpoint} has no {TACO_STATE}/ to restore a tensor-parallel model from; resume "
                "from a checkpoint this Trainer wrote with save_only_model=False"
            )

    def _load_best_model(self) -> None:
        if not self._sharded():
            return super()._load_best_model()
        folder = Path(self.state.best_model_checkpoint) / TACO_STATE
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is missing: load_best_model_at_end restores a tensor-parallel model "
                                  "from its sharded state; keep save_only_model=False")
        logger.info("loading the best model from %s (score %s)", folder.parent, self.state.best_metric)
        self.accelerator.load_state(folder)  # the model's shards, and that step's optimizer state and RNG

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._sharded():
            return super()._load_optimizer_and_scheduler(checkpoint)
        folder = Path(checkpoint) / TACO_STATE
        if not folder.is_dir():
            if (Path(checkpoint) / "optimizer.pt").exists():
                raise CheckpointError(
                    f"{checkpoint} holds one process's optimizer state (optimizer.pt), not the tensor-parallel "
                    f"shards ({TACO_STATE}/): it was not written by a taco_accel Trainer. Start from its weights "
                    "(from_pretrained) without resume_from_checkpoint"
                )
            return  # save_only_model: nothing to restore, as the Trainer does
        self.accelerator.load_state(folder)
        schedule = Path(checkpoint) / "scheduler.pt"
        if schedule.exists():
            self.lr_scheduler.load_state_dict(torch.load(schedule, weights_only=True))


# settings refused at tp > 1: (name, why, what to do instead)
_REFUSED_AT_TP = (
    ("neftune_noise_alpha", "NEFTune's noise hook reads its alpha from the input embedding, which tensor parallelism "
     "replaces with a vocab-parallel one", "leave neftune_noise_alpha unset"),
    ("precompute_ref_log_probs", "DPO's reference pass over the dataset runs inside the trainer's construction, "
     "before taco_trainer lays the models out, and does not keep the tp ranks in step", "leave it off (the reference "
     "model then scores each batch as it trains)"),
)


def _refuse_at_tp(args, tp: int) -> None:
    """A ValueError at tp > 1 for the settings of `_REFUSED_AT_TP`."""
    for name, why, fix in _REFUSED_AT_TP if tp > 1 else ():
        if getattr(args, name, None) not in (None, False):
            raise ValueError(f"{name}={getattr(args, name)!r} at tp={tp}: {why}; {fix}")


class _ReplicaRollouts:
    """Put in front of TRL's GRPO and RLOO trainers: their rewards, KL terms and logs are gathered
    over the data-parallel replicas, each row once (`upstream.trl.gathering_with` says why)."""

    def _generate_and_score_completions(self, inputs):
        gather_object = functools.partial(replicas.gather_object, dp=self.accelerator.torch_device_mesh["dp"])
        with upstream_trl.gathering_with(upstream_trl.online_trainer(type(self)), self.accelerator.gather, gather_object):
            return super()._generate_and_score_completions(inputs)


def _processes_on_cpu(args) -> None:
    """``TrainingArguments`` set Accelerate's process state up when they were built; without
    ``use_cpu`` on a machine without GPUs, N launched processes became N one-process runs
    (``DistributedType.NO``). Set it up again with ``use_cpu=True`` (gloo, MULTI_CPU)."""
    if torch.cuda.is_available() or args.use_cpu or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    args.use_cpu = True
    upstream_transformers.setup_devices_again(args)  # Accelerate's state, built for the CPU processes
