"""Accelerate's private names that `taco_accel.Accelerator` and its checkpoints rely on, and its
scheduler's count under TP.

- the lists an ``Accelerator`` keeps of what it prepared (``_optimizers``, ``_schedulers``,
  ``_dataloaders``) and registered (``_custom_objects``): our ``prepare_*`` append to them, as
  Accelerate's own do, and a checkpoint saves what they hold;
- the ``_is_accelerate_prepared`` mark on what ``prepare`` returned;
- the hooks of ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
  (``_save_model_state_pre_hook``, ``_load_model_state_pre_hook``), which our ``save_state`` /
  ``load_state`` run as Accelerate's do;
- ``PartialState.split_between_processes``'s generator (``__wrapped__`` under its
  ``contextmanager``), which reads only ``num_processes``, ``process_index`` and ``device`` of its
  state: `split_between` runs it over the data-parallel replicas;
- `compiling_nothing`: Accelerate's ``prepare_model`` (1.15 and 1.16) wraps the model in
  ``torch.compile`` (or its own regional compile) when ``state.dynamo_plugin.backend`` is not
  ``NO`` and the model is not an ``OptimizedModule``; taco_accel compiles per decoder block
  itself, so the plugin reads ``NO`` while that runs;
- `ReplicaScheduler`: ``AcceleratedScheduler`` steps the schedule once per process per optimizer
  step (``num_processes`` times), the number of batches a step consumes when every process reads
  its own; under TP the tp ranks of a replica read one batch, so it steps once per dp replica.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import torch.distributed as dist
from accelerate.scheduler import AcceleratedScheduler

from .versions import check_range

logger = logging.getLogger(__name__)

SUPPORTED = ("1.15", "1.17")

PREPARED = {"optimizer": "_optimizers", "scheduler": "_schedulers", "dataloader": "_dataloaders",
            "custom": "_custom_objects"}


def check_version() -> str | None:
    """The installed Accelerate version; a ConfigError outside `SUPPORTED`."""
    return check_range("accelerate", *SUPPORTED)


def prepared(accelerator, kind: str) -> list:
    """The accelerator's own list of prepared objects of ``kind`` (see `PREPARED`)."""
    return getattr(accelerator, PREPARED[kind])


def add_prepared(accelerator, kind: str, obj) -> None:
    """Keep ``obj`` in the accelerator's list of ``kind``, as Accelerate's ``prepare_*`` do."""
    prepared(accelerator, kind).append(obj)


def is_prepared(obj) -> bool:
    """Whether ``obj`` came out of an Accelerator's ``prepare`` (Accelerate's mark)."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def save_state_pre_hooks(accelerator) -> list:
    """The hooks ``register_save_state_pre_hook`` registered, in order."""
    return list(accelerator._save_model_state_pre_hook.values())


def load_state_pre_hooks(accelerator) -> list:
    """The hooks ``register_load_state_pre_hook`` registered, in order."""
    return list(accelerator._load_model_state_pre_hook.values())


@contextlib.contextmanager
def split_between(inputs, processes: int, index: int, device, apply_padding: bool = False):
    """Accelerate's ``split_between_processes`` of ``inputs`` into ``processes`` shares, share
    ``index`` (Accelerate splits over every process; here the caller's count, e.g. the replicas).
    ``apply_padding`` of a tensor pads it across every process, as Accelerate's does (a collective
    of every rank)."""
    from accelerate.state import PartialState

    split = contextlib.contextmanager(PartialState.split_between_processes.__wrapped__)
    with split(SimpleNamespace(num_processes=processes, process_index=index, device=device), inputs,
               apply_padding) as share:
        yield share


@contextlib.contextmanager
def compiling_nothing(accelerator):
    """Inside the block, Accelerate's ``prepare_model`` compiles nothing (see the module doc): the
    shared state's ``dynamo_plugin`` is one with backend ``NO``, the user's one again after it
    (whatever the block raised)."""
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    state = accelerator.state
    plugin = state.dynamo_plugin
    if plugin is None or plugin.backend == DynamoBackend.NO:
        yield
        return
    state.dynamo_plugin = TorchDynamoPlugin(backend="no")
    try:
        yield
    finally:
        state.dynamo_plugin = plugin


class ReplicaScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper, stepping ``replicas`` (the dp replicas) times per optimizer
    step where Accelerate steps once per process; otherwise Accelerate's rules (accumulation,
    skipped optimizer steps, ``split_batches``, ``step_with_optimizer``).

    Warns once (main process) when a schedule of known length (``OneCycleLR``'s ``total_steps``,
    the ``num_training_steps`` of transformers' ``get_scheduler``) is already more than
    ``max(replicas, length // 10)`` scheduler steps past its end: sizing from ``len(dataloader)``
    rounds each epoch up by less than ``replicas`` steps, while a schedule sized for the wrong
    number of processes ends a whole fraction of the run early.
    """

    def __init__(self, *args, replicas: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.replicas, self._warned = replicas, False

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or self.split_batches:
            return super().step(*args, **kwargs)
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.replicas):
            if getattr(self.scheduler, "total_steps", None) is not None and \
                    self.scheduler._step_count > self.scheduler.total_steps:
                break
            self.scheduler.step(*args, **kwargs)
        self._check_length()

    def _check_length(self) -> None:
        length = _schedule_length(self.scheduler)
        if self._warned or length is None or self.scheduler.last_epoch - length <= max(self.replicas, length // 10):
            return
        self._warned = True
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(
                "the learning-rate schedule is %d scheduler steps past its end (%d steps) and the optimizer still "
                "steps: it was sized for fewer steps than this run takes. A prepared scheduler steps %d times per "
                "optimizer step, once per data-parallel replica (taco_accel.Accelerator's num_processes; the tensor- "
                "and pipeline-parallel ranks of a replica count once): size warm-up and length by "
                "accelerator.num_processes (not num_processes // tp_size)",
                self.scheduler.last_epoch - length, length, self.replicas)


def _schedule_length(scheduler) -> int | None:
    """The number of scheduler steps a schedule is built for, where it says: ``OneCycleLR``'s
    ``total_steps``, the ``num_training_steps`` of transformers' ``get_scheduler`` lambdas."""
    total = getattr(scheduler, "total_steps", None)
    if total is not None:
        return int(total)
    for fn in getattr(scheduler, "lr_lambdas", ()):
        steps = getattr(fn, "keywords", {}).get("num_training_steps")
        if isinstance(steps, int):
            return steps
    return None
