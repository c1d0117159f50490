"""`taco_accel.Accelerator`: Accelerate's `Accelerator` for TACO tensor-parallel models.

A user's own Accelerate loop changes its import and nothing else::

    from taco_accel import Accelerator            # instead of: from accelerate import Accelerator

    accelerator = Accelerator()                   # sizes: the launch config's parallelism_config, or
                                                  # Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt"); accelerator.save_model(model, "final")

What differs from ``accelerate.Accelerator``, and why:

- **The mesh** ``("pp", "dp", "tp")`` is built here, on every device type, from
  Accelerate's own sizes (``tp_size``; ``dp_shard_size`` -> FSDP2, ``dp_replicate_size`` ->
  replicas averaging gradients; ``pp_size`` for pipeline stages): Accelerate shards nothing
  itself, refuses TP on CPU and TP with replicated dp. One code path on gloo and NCCL.
- **prepare(model)** tensor-parallelises the model over the mesh's tp ranks (a model already
  given to `taco_accel.parallelize` is checked against the mesh instead), places it, applies
  data parallelism over dp only (never DDP across TP ranks, whose broadcast would overwrite
  the shards) and Accelerate's mixed precision. Optimizers passed in the same call are
  re-pointed at the new parameters, as Accelerate does for FSDP2. One process with
  ``tp_size > 1`` runs emulated TP (`parallelize(..., emulate=True)`): the numerics, not the speed.
- **prepare(dataloader)** is Accelerate's own sharding with the dp ranks as its processes: the
  tp (and pp) ranks of one replica read the same batches.
- **Gradients** are reduced once per optimizer step, after the last backward, before clipping
  or the step (as Accelerate's XLA path does), so ``accumulate`` / ``no_sync`` need no
  communication; ``clip_grad_norm_`` returns the norm of the whole model over every shard.
- ``gather`` / ``gather_for_metrics`` / ``reduce`` run over the dp ranks; ``save_state`` /
  ``load_state`` write and read taco_accel's checkpoint (every rank's shards, atomic,
  checksummed, resumable on another mesh; the folder's other files untouched); ``save_model`` /
  ``get_state_dict`` gather the full model: a plain transformers checkpoint.
  ``compression_stats()`` gives the TACO byte counts for ``log``.
- **num_processes** is the number of data-parallel replicas, and ``process_index`` this
  process's replica, in every accelerator the package hands out (this one, and the one
  `taco_trainer` builds for transformers' Trainer and TRL): the tensor- and pipeline-parallel
  ranks of a replica read the same batches and count once. That is what Accelerate's arithmetic
  means by it ("how many batches one optimizer step reads"), and the one count that keeps the
  arithmetic of scripts written for Accelerate right: transformers' ``run_clm_no_trainer.py``
  sizes warm-up as ``num_warmup_steps * num_processes``, the schedule as ``max_train_steps *
  num_processes`` or from ``len(dataloader)`` before ``prepare`` (the global batches), and
  reports ``per_device_batch * num_processes * accumulation`` as the total batch; a prepared
  scheduler steps ``num_processes`` times per optimizer step (`upstream.accelerate.ReplicaScheduler`),
  so only the replica count makes both of its schedule paths what one process gets (with every
  process counted, no stepping rule makes both right). ``parallelism_config`` describes the same
  replicas (Accelerate's ``ParallelismConfig``, ``total_size == num_processes``, tp 1): the
  libraries built on Accelerate that divide by its tp size where processes share a batch
  (transformers' Trainer: its loss scale ``num_processes // tp``, its token counts; TRL's token
  counts) then compute right by themselves. ``gather``, ``reduce``, ``gather_for_metrics`` and
  ``split_between_processes`` run over the replicas (the tp ranks of a replica get the same
  share). Every process started: ``world_size``; the mesh: ``parallel_dims`` and
  ``torch_device_mesh``; ``is_main_process`` and ``local_process_index`` stay Accelerate's. A
  schedule that ends long before the run does (sized by ``num_processes // tp``) is warned about once.
- **Outputs**: ``outputs.logits`` has the full vocabulary, as transformers returns it; the loss
  is vocab-parallel inside. ``logits="local"`` / ``"none"`` opt out (`taco_accel.models.loss`).

This module adapts Accelerate's methods; each concern lives in its own module of this package
(the package doc lists them).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator as _AccelerateAccelerator
from accelerate.utils import DistributedType
from torch import nn

from ..models.loss import LogitsMode, check_logits_mode
from ..parallel import ModelParts, ParallelDims, build_mesh, clip_grad_norm_, distribute, has_decoder_layers, is_compiled
from ..parallel.mesh import launch_sizes
from ..comm.policy import DEFAULT_COMPRESSION, Compression
from ..upstream import accelerate as upstream
from ..upstream.transformers import trainer_builds_with
from . import precision, replicas, saving, sizes, statistics
from .gradients import FsdpNoSync, StepOptimizer
from .laid_out import LaidOutModels
from .launch import launch_notes, without_parallelism_config
from .wire import StepWire

logger = logging.getLogger(__name__)

_REFUSED_PLUGINS = {
    "deepspeed_plugin": "DeepSpeed", "deepspeed_plugins": "DeepSpeed", "fsdp_plugin": "Accelerate's FSDP plugin",
    "megatron_lm_plugin": "Megatron-LM", "torch_tp_plugin": "Accelerate's TP plugin",
}


class Accelerator(_AccelerateAccelerator):
    """``accelerate.Accelerator`` that trains TACO tensor-parallel models (see the module doc).

    Args:
        parallelism_config: Accelerate's ``ParallelismConfig``: ``tp_size``, ``dp_shard_size``
            (FSDP2 over dp) or ``dp_replicate_size`` (replicas averaging gradients). Default:
            the launch config's ``parallelism_config`` block (``PARALLELISM_CONFIG_*``), else
            tp=1 and data parallelism over every process. As in Accelerate, sizes whose product
            is not the number of processes raise a ValueError (all sizes 1: dp over every
            process), unless ``pp_size`` (or ``TACO_PP_SIZE``) asks for pipeline stages.
        parallel_dims: taco_accel's own sizes (`ParallelDims`), instead of the above.
        pp_size: pipeline stages (default: ``TACO_PP_SIZE``, else 1).
        compression: how a model that ``prepare`` parallelises compresses its TP collectives:
            anything `Compression.resolve` takes, resolved here (``accelerator.compression`` is
            the `Compression`). ``"auto"`` (default: each communication site compressed only
            where timing on the real group in the first step says it pays), ``"on"`` or a
            `TacoConfig`, ``"off"`` / ``None``, a `Compression`, its dict or JSON file.
        grad_compression: how the data-parallel gradient reduction is compressed (DDP's average
            and FSDP2's reduce-scatter over the dp replicas), in the same forms; ``"off"`` by
            default (opt-in until the accuracy study says otherwise). On: FP8 with error feedback
            (`taco_accel.parallel.data_parallel`: fp32 residuals of 4 bytes per local gradient
            value, kept in checkpoints); its sites are ``dp.grad.*``, with ``backward``'s settings.
        sequence_parallel: Megatron sequence parallelism inside TP, for such a model.
        logits: what ``outputs.logits`` holds for the models prepared here (`parallelize`'s
            ``logits``): ``"full"`` (the full vocabulary, transformers' convention) or
            ``"local"`` (this rank's vocabulary slice when ``labels`` are given: no all-gather,
            no (b, s, V) tensor; only ``outputs.loss`` is whole) or ``"none"`` (no logits when
            ``labels`` are given: the head and loss fused, in chunks). Default None: ``"full"`` for
            a model ``prepare`` parallelises, the model's own setting for one already parallel.
        **kwargs: everything ``accelerate.Accelerator`` takes, except the DeepSpeed, FSDP,
            Megatron-LM and TP plugins (taco_accel does their job). A collective waits at most
            ``InitProcessGroupKwargs(timeout=...)``'s timeout for a peer (default: the
            ``TACO_TIMEOUT_S`` environment variable, else 10 minutes; Accelerate's is 30).
    """

    def __init__(self, *args, parallelism_config=None, parallel_dims: ParallelDims | None = None,
                 pp_size: int | None = None, compression=DEFAULT_COMPRESSION, grad_compression="off",
                 sequence_parallel: bool = False, logits: LogitsMode | None = None, **kwargs):
        upstream.check_version()
        self._refuse_a_plain_trainer()
        compression = Compression.resolve(compression)  # before any process group starts
        grad_compression = Compression.resolve(grad_compression)
        for name, what in _REFUSED_PLUGINS.items():
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"taco_accel.Accelerator does not take {name} ({what}): it lays the model out itself; give "
                    "the sizes as parallelism_config=ParallelismConfig(tp_size=..., dp_shard_size=... for FSDP2)"
                )
        if logits is not None:
            check_logits_mode(logits)
        if parallelism_config is None and parallel_dims is None:
            parallelism_config = launch_sizes()  # the launch config's parallelism_config block, if any
        if not torch.cuda.is_available():
            kwargs["cpu"] = True  # else Accelerate treats N CPU processes as N separate single-process runs
        timeout = sizes.with_timeout(kwargs)
        # this Accelerator's own compile switch: Accelerate keeps the first one of the process in its state
        self._dynamo_plugin = kwargs.get("dynamo_plugin")
        if self._dynamo_plugin is None and kwargs.get("dynamo_backend") is not None:
            from accelerate.utils import TorchDynamoPlugin

            self._dynamo_plugin = TorchDynamoPlugin(backend=kwargs["dynamo_backend"])
        with without_parallelism_config():  # Accelerate would build (or refuse) its own mesh
            super().__init__(*args, **kwargs)
        if self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise ValueError(
                f"the launch config selects {self.distributed_type.value}; taco_accel.Accelerator lays the model "
                "out itself: use distributed_type MULTI_GPU (or --multi_gpu) with a parallelism_config block "
                "(parallelism_config_tp_size, parallelism_config_dp_shard_size for FSDP2)"
            )
        self._mesh_scaler()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.state.num_processes:
            raise RuntimeError(f"torch.distributed has {world} processes but Accelerate sees "
                               f"{self.state.num_processes} ({self.distributed_type.value}); launch with accelerate "
                               "launch or torchrun")
        self.parallel_dims, self.emulated_tp = sizes.mesh_sizes(parallel_dims, parallelism_config, pp_size, world)
        self._accelerate_sizes = sizes.describe(self.parallel_dims)
        self._taco_mesh = build_mesh(self.parallel_dims, self.device.type, timeout)
        # sliced once: a DeviceMesh slice builds and reads index tensors, which gather / reduce,
        # called every step by the Trainer, would otherwise repeat
        self._replica_mesh = self._taco_mesh["dp"]
        self.compression, self.sequence_parallel, self.logits = compression, sequence_parallel, logits
        self.grad_compression = grad_compression
        self.laid_out = LaidOutModels()  # the models prepared here, each with its ModelParts
        self.step_wire = StepWire(self.laid_out.ledgers, self.device, world,
                                  compression.mode != "off" or grad_compression.mode != "off",
                                  self.scaler if self.mixed_precision == "fp16" else None)
        self._checkpoints = saving.Checkpoints()
        if self.is_main_process:
            for note in launch_notes(world):
                logger.warning(note)
            logger.info("taco_accel: %s; accelerator.num_processes = %d data-parallel replica(s), each reading its own "
                        "batches (what batch and schedule arithmetic counts); accelerator.world_size = %d processes",
                        self.parallel_layout, self.num_processes, world)

    def _refuse_a_plain_trainer(self) -> None:
        """A ValueError when transformers' Trainer is set to build this class (a replaced
        ``transformers.trainer.Accelerator``) instead of `taco_trainer`'s way: the plain Trainer
        saves its checkpoints from the main process alone, which holds its own shards only."""
        builder = trainer_builds_with()
        if not (isinstance(builder, type) and issubclass(builder, Accelerator) and isinstance(self, builder)):
            return
        raise ValueError(
            f"transformers.trainer.Accelerator is {builder.__module__}.{builder.__name__}: a plain Trainer on it would "
            "save its checkpoints (model, optimizer) from the main process alone, which holds only its own shards of "
            "a tensor-parallel model, and would report every process as a replica in its batch size. Leave "
            "transformers.trainer.Accelerator as it is and use taco_accel.taco_trainer: taco_trainer(Trainer)(model=..., "
            "args=...), which builds the Trainer's accelerator itself"
        )

    def _mesh_scaler(self) -> None:
        """fp16: autocast and the mesh's gradient scaler on every device type (`precision.mesh_scaler`)."""
        scaler = precision.mesh_scaler(self.mixed_precision, self.scaler_handler, self.device.type)
        if scaler is not None:
            self.native_amp, self.scaler = True, scaler

    # -- the mesh ---------------------------------------------------------------------------
    @property
    def torch_device_mesh(self):
        """The ``("pp", "dp", "tp")`` DeviceMesh of this run."""
        return self._taco_mesh

    @property
    def parallelism_config(self):
        """Accelerate's ``ParallelismConfig`` of the data-parallel replicas, the processes
        `num_processes` counts (``dp_shard_size`` under FSDP2, else ``dp_replicate_size``; tp 1:
        a replica's tensor-parallel ranks count once), what transformers' Trainer and TRL divide
        their counts by (`sizes.describe`). The mesh itself: `parallel_dims`, `torch_device_mesh`.
        A description only: Accelerate builds no mesh from it, and `prepare` hides it from Accelerate."""
        return getattr(self, "_accelerate_sizes", None)  # None while Accelerate's own __init__ runs

    @property
    def tensor_parallel_rank(self) -> int:
        return self._taco_mesh["tp"].get_local_rank()

    @property
    def pipeline_parallel_rank(self) -> int:
        return self._taco_mesh["pp"].get_local_rank()

    @property
    def data_parallel_rank(self) -> int:
        return self._replica_mesh.get_local_rank()

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp

    @property
    def num_processes(self) -> int:
        """The data-parallel replicas: how many batches one optimizer step reads (the tp and pp
        ranks of a replica count once; every process: `world_size`; the module doc says why)."""
        dims = getattr(self, "parallel_dims", None)  # None while Accelerate's __init__ runs
        return self.state.num_processes if dims is None else dims.dp

    @property
    def world_size(self) -> int:
        """Every process of the run (pp x dp x tp; Accelerate's ``state.num_processes``)."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """This process's data-parallel replica, in ``range(num_processes)`` (the global rank is
        ``state.process_index``)."""
        if getattr(self, "_taco_mesh", None) is None:
            return self.state.process_index
        return self.data_parallel_rank

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def parallel_layout(self) -> str:
        """The layout in words: ``"pp=1 x dp=2 (ddp) x tp=2"``, or ``"... x tp=2 emulated in one process"``."""
        if self.emulated_tp > 1:
            return f"tp={self.emulated_tp} emulated in one process"
        return str(self.parallel_dims)

    @property
    def should_save_model(self) -> bool:
        return True  # every rank takes part in the (collective) saves; rank 0 writes what is shared

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """Accelerate's ``prepare``; models are laid out on the mesh first, and the optimizers
        passed in the same call are re-pointed at their new (sharded) parameters."""
        moved: dict[int, nn.Parameter] = {}
        for obj in args:
            if isinstance(obj, nn.Module) and not upstream.is_prepared(obj):
                moved.update(self._lay_out(obj)[1])
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    group["params"] = [moved.get(id(p), p) for p in group["params"]]
        described, self._accelerate_sizes = self._accelerate_sizes, None  # else Accelerate's own (DTensor) TP path runs
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._accelerate_sizes = described

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Lay ``model`` out on the mesh (if `prepare` has not), compiled per decoder block when
        Accelerate's compile switch is on (`_dynamo_settings`), then Accelerate's mixed precision;
        never Accelerate's DDP / FSDP wrappers, nor its whole-model ``torch.compile``.
        ``evaluation_mode=True`` (as in Accelerate: a model for inference only): tensor parallel
        and placed, without FSDP2 sharding or gradient reductions."""
        if not upstream.is_prepared(model) and self.laid_out.parts_of(model) is None:
            self._lay_out(model, evaluation=evaluation_mode)
        with upstream.compiling_nothing(self):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_pipeline(self, model: nn.Module, *, micro_batches: int, schedule: str = "1f1b",
                         stages_per_rank: int | None = None, seq_len: int = 2048, loss_fn=None,
                         shifted_labels: bool = False):
        """Pipeline-parallel training of ``model`` over the mesh's pp ranks: split into stages,
        tensor and data parallel like `prepare`; returns a `PipelineRunner` whose
        ``step(input_ids, labels)`` runs forward and backward of ``micro_batches`` micro-batches
        with ``schedule`` ("gpipe", "1f1b", "interleaved_1f1b"). Create the optimizer over
        ``runner.parameters()`` afterwards and `prepare` it; clip with ``clip_grad_norm_``.
        ``loss_fn(logits, labels)`` defaults to the model's own (vocab-parallel) loss; a custom
        one gets the full logits (this rank's vocabulary slice under ``logits="local"``);
        ``shifted_labels``: the labels are already the next tokens (packed pretraining data).
        """
        from ..parallel.pipeline import PipelineRunner

        stages_per_rank = stages_per_rank or (2 if schedule == "interleaved_1f1b" else 1)
        parts, _ = self._lay_out(model, pipeline=True, stages_per_rank=stages_per_rank, seq_len=seq_len)
        return PipelineRunner(parts, schedule, micro_batches, self.device, loss_fn=loss_fn,
                              shifted_labels=shifted_labels, autocast=self.autocast)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's DataLoader sharding over the dp ranks only: every tp and pp rank of a
        replica gets the same batches."""
        from accelerate.data_loader import prepare_data_loader

        if upstream.is_prepared(data_loader):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches and self.parallel_dims.world_size > self.parallel_dims.dp:
            raise ValueError(
                "dispatch_batches=True splits each batch over all processes, tensor-parallel ranks included; "
                "leave it unset (DataLoaderConfiguration(dispatch_batches=None)) with taco_accel"
            )
        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.parallel_dims.dp, process_index=self.data_parallel_rank,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False, even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        upstream.add_prepared(self, "dataloader", prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        """Accelerate's optimizer wrapper, whose ``step`` first reduces the step's gradients."""
        if upstream.is_prepared(optimizer):
            return super().prepare_optimizer(optimizer, device_placement)
        stale = self.laid_out.replaced_in(optimizer)
        if stale:
            raise ValueError(
                f"the optimizer holds {stale} parameter(s) that prepare() replaced by their tensor-parallel shards; "
                "pass the model and the optimizer to the same accelerator.prepare(...) call, or create the "
                "optimizer from model.parameters() after prepare(model)"
            )
        if device_placement is None:
            device_placement = self.device_placement
        prepared = StepOptimizer(optimizer, self._finish_gradients, self._step_done, self.step_wire,
                                 device_placement=device_placement, scaler=self.scaler)
        upstream.add_prepared(self, "optimizer", prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        """Accelerate's scheduler wrapper, stepping once per dp replica per optimizer step
        (`upstream.accelerate.ReplicaScheduler`)."""
        if upstream.is_prepared(scheduler):
            return super().prepare_scheduler(scheduler)
        optimizers = upstream.prepared(self, "optimizer")
        optimizer = next((o for o in optimizers if getattr(scheduler, "optimizer", None) is o.optimizer), optimizers)
        prepared = upstream.ReplicaScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                             split_batches=self.split_batches, replicas=self.parallel_dims.dp)
        upstream.add_prepared(self, "scheduler", prepared)
        return prepared

    def _emulate(self, model: nn.Module) -> None:
        from ..models import parallelize

        if getattr(model, "taco", None) is None:
            parallelize(model, tp=self.emulated_tp, compression=self.compression,
                        sequence_parallel=self.sequence_parallel, emulate=True, logits=self.logits or "full")

    def _dynamo_settings(self, model: nn.Module) -> dict:
        """Accelerate's own compile switch (``dynamo_backend`` / ``TorchDynamoPlugin``, what
        ``TrainingArguments(torch_compile=True)`` sets) as `distribute`'s arguments for ``model``:
        every door compiles each decoder block on its own and the loss's chunk kernels
        (`parallel.apply_compile`), never the whole model; its mode, fullgraph and dynamic are
        honoured. Nothing for a model already compiled (a ``torch.compile`` wrapper, compiled
        blocks), as Accelerate leaves one; a ValueError for a model without decoder blocks."""
        from accelerate.utils import DynamoBackend

        plugin = self._dynamo_plugin or self.state.dynamo_plugin
        if plugin is None or plugin.backend == DynamoBackend.NO or is_compiled(model):
            return {}
        if not has_decoder_layers(model):
            raise ValueError(
                f"dynamo_backend={plugin.backend.value.lower()!r}: taco_accel compiles each decoder block of a "
                f"supported causal LM on its own, and {type(model).__name__} has none; compile it yourself before "
                "prepare (torch.compile(model)) or leave Accelerate's compile off (dynamo_backend='no', "
                "TrainingArguments(torch_compile=False))")
        return {"compile": plugin.backend.value.lower(),
                "compile_options": {"mode": plugin.mode, "fullgraph": plugin.fullgraph, "dynamic": plugin.dynamic}}

    def _lay_out(self, model: nn.Module, **pipeline) -> tuple[ModelParts, dict[int, nn.Parameter]]:
        """`distribute` ``model`` over the mesh (emulated TP in one process), kept in `laid_out`;
        its parts and the new parameter of each replaced one (`LaidOutModels.add`).
        ``pipeline``: `distribute`'s pipeline and evaluation arguments."""
        precision.check_precision(self.mixed_precision, model, bool(pipeline.get("pipeline")))
        compile_settings = self._dynamo_settings(model)  # before any collective: an error on every rank
        if self.emulated_tp > 1:
            self._emulate(model)
        before = dict(model.named_parameters())
        parts = distribute(model, self._taco_mesh, self.parallel_dims, compression=self.compression,
                           grad_compression=self.grad_compression,
                           sequence_parallel=self.sequence_parallel, logits=self.logits,
                           device=self.device if self.device_placement or pipeline else None,
                           param_dtype=precision.fsdp_param_dtype(self.parallel_dims, self.mixed_precision),
                           **compile_settings, **pipeline)
        return parts, self.laid_out.add(model, parts, before)

    def _finish_gradients(self) -> None:
        """Reduce the step's gradients (once; `ModelParts.finish_gradients`), unless inside an
        accumulation that has not reached its optimizer step."""
        if self.sync_gradients:
            self.laid_out.finish_gradients()

    def _step_done(self) -> None:
        """The optimizer stepped or zeroed the gradients: the next backward starts a new step."""
        self.laid_out.step_done()
        self.step_wire.step_done()

    # -- gradients --------------------------------------------------------------------------
    def no_sync(self, model):
        """Accumulate without reducing: the reduction happens once, before the optimizer step;
        FSDP2 only skips its per-micro-batch reduce-scatter."""
        return FsdpNoSync(model)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """Clip by the norm of the whole model's gradient (every tp shard, pipeline stage and
        FSDP shard counted once); returns that norm (before clipping) as a tensor. A collective."""
        if norm_type != 2:
            raise ValueError(f"norm_type={norm_type!r}: taco_accel clips by the 2-norm only; use norm_type=2")
        params = list(parameters)
        owners = self.laid_out.owners_of(params)
        # before the unscale: fp16's overflow check (and the wire check it carries) then covers
        # every collective of the step, the data-parallel reduction's too
        self._finish_gradients()
        self.unscale_gradients()
        # inside an accumulation (sync_gradients False): the local gradients as they are, as
        # Accelerate's DDP under no_sync; the reduction waits for the step
        wire = self.step_wire.fold() if self.sync_gradients else None  # summed in the norm's all-reduce
        norm = clip_grad_norm_(owners, params, max_norm, finish=self.sync_gradients, extra=wire)
        return norm.float()  # fp32, as Accelerate

    def read_with_wire_check(self, values: torch.Tensor) -> list[float]:
        """``values`` (a 1-D tensor on this device: the figures a training loop reads every step)
        as floats, read together with the step's wire-header flag in one host transfer: a
        `WireFormatError` on every rank if a compressed chunk of the step's collectives had
        another header (its values read as NaN). Call it after ``clip_grad_norm_`` and before
        ``optimizer.step()``, which then reads nothing more (`wire.StepWire`)."""
        return self.step_wire.read_with(values)

    # -- evaluation -------------------------------------------------------------------------
    def gather(self, tensor):
        """Concatenate ``tensor`` (or a nested structure of tensors) over the dp ranks along dim 0."""
        return replicas.gather(tensor, self._replica_mesh)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """`gather` (or an object gather) over the dp ranks, without the samples the sharded
        DataLoader repeated to fill its last batch."""
        return replicas.gather_for_metrics(input_data, self._replica_mesh, self.gradient_state, use_gather_object)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Reduce over the dp ranks (``"sum"``, ``"mean"`` or ``"none"``)."""
        return replicas.reduce(tensor, self._replica_mesh, reduction)

    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Accelerate's split of ``inputs`` (a list, tuple, tensor, dict of them, or a datasets
        ``Dataset``) into `num_processes` shares, this replica's share for this process: the
        tensor- and pipeline-parallel ranks of a replica get the same one (a context manager)."""
        return upstream.split_between(inputs, self.num_processes, self.process_index, self.device, apply_padding)

    def compression_stats(self, model: nn.Module | None = None) -> dict[str, float]:
        """What the TP (and pipeline, compressed dp) collectives of ``model`` (None: every model
        prepared here) sent on all ranks since the last call, for ``accelerator.log``:
        ``comm/bytes_sent``, ``comm/bytes_saved`` (against plain collectives) and
        ``comm/compression`` (plain / sent). Reads (and resets) only those models' figures: a
        reference model's or an EMA copy's are its own. A collective; per-site figures:
        ``model.taco.sites.pop_stats()``."""
        return statistics.compression_stats(self.comm_ledgers(model), self.device)

    def comm_ledgers(self, model: nn.Module | None = None) -> list:
        """The statistics ledgers of ``model``'s communication sites (None: of every model prepared
        here), each once (`comm.stats.pop_ledgers` reads them)."""
        return self.laid_out.ledgers(model)

    def compression_decisions(self) -> dict[str, dict]:
        """Every communication site of the prepared models, over all pipeline stages: its mode
        and, for ``"auto"`` sites that have run, the timing decision (`SiteTable.decisions`).
        JSON-ready, for a run's record. A collective."""
        return statistics.compression_decisions(self.laid_out.parts)

    # -- saving -----------------------------------------------------------------------------
    def get_state_dict(self, model, unwrap: bool = True):
        """The full (unsharded) state dict with transformers' names, on every rank: a collective
        for a tensor-parallel model (`saving.full_state_dict`)."""
        state = saving.full_state_dict(self.unwrap_model(model) if unwrap else model)
        return super().get_state_dict(model, unwrap) if state is None else state

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True) -> None:
        """Write the full model as a plain transformers checkpoint (a peft model: its adapter, in
        peft's format at full shapes). A collective: call it on every rank."""
        if not saving.save_full_model(self.unwrap_model(model), save_directory, max_shard_size):
            super().save_model(model, save_directory, max_shard_size, safe_serialization)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> Path:
        """Every rank's shard of the models, optimizers, schedulers, the gradient scaler, DataLoader
        positions, RNG states and registered objects, written atomically into ``output_dir`` as
        one reshardable checkpoint (see `checkpoint`: it resumes on another mesh too); other files
        in the folder stay as they are. With ``ProjectConfiguration(automatic_checkpoint_naming=True)``:
        ``project_dir/checkpoints/checkpoint_<i>``. Hooks of `register_save_state_pre_hook` run
        first, as in Accelerate: ``hook(models, weights, output_dir)``, where ``weights[i]`` is
        this rank's state dict of model i (its shards); entries or whole models the hook removes
        are not saved. ``safe_serialization``: accepted as in Accelerate; the checkpoint is read
        back without running pickled code either way (the full model as safetensors is
        `save_model`). ``save_model_func_kwargs`` are DeepSpeed's in Accelerate: none applies
        here (a warning names them). A collective; returns the folder."""
        return self._checkpoints.save(self, output_dir, safe_serialization, save_model_func_kwargs)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs) -> None:
        """Restore what `save_state` wrote, from any mesh: the models' shards are read from the
        blocks that cover them. ``input_dir=None`` with automatic checkpoint naming: the newest
        complete checkpoint (a damaged one is skipped with a warning). Hooks of
        `register_load_state_pre_hook` run first, as in Accelerate: ``hook(models, input_dir)``;
        models the hook removes from the list are not loaded (it restored them itself).
        ``strict=False`` (as Accelerate passes it to ``load_state_dict``) leaves the model
        entries the checkpoint lacks as they are; ``map_location`` and ``load_kwargs`` (torch.load's)
        are accepted: every value goes to the device of what it restores, read with
        ``weights_only=True``. A collective; every rank must name the same checkpoint."""
        self._checkpoints.load(self, input_dir, load_model_func_kwargs)
