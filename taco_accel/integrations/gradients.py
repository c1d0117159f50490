"""When a `taco_accel.Accelerator` reduces gradients: once per optimizer step, after the last
backward, so that accumulation needs no communication.

- `StepOptimizer`: Accelerate's optimizer wrapper whose real step first reduces the step's
  gradients over the mesh (unless clipping already has) and then opens the next step;
- `FsdpNoSync`: ``no_sync`` for such models: FSDP2 modules skip their per-micro-batch
  reduce-scatter; the others have nothing to skip;
- `owners_of`: the prepared models whose gradients a clip reduces and measures.
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..parallel import ModelParts


class StepOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose real steps first reduce the step's gradients (if
    clipping has not) and then open the next step (``done``)."""

    def __init__(self, optimizer, finish, done, **kwargs):
        super().__init__(optimizer, **kwargs)
        self._finish, self._done = finish, done
        self.steps = 0  # optimizer steps taken (not skipped): the training step a checkpoint records

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return super().step(closure)
        self._finish()
        try:
            out = super().step(closure)
            self.steps += not self.step_was_skipped
            return out
        finally:
            self._done()

    def zero_grad(self, set_to_none=None):
        if self.gradient_state.sync_gradients:
            self._done()
        return super().zero_grad(set_to_none)


class FsdpNoSync:
    """``no_sync`` for our models: FSDP2 modules skip their reduce-scatter until the last
    micro-batch; for the others there is nothing to skip."""

    def __init__(self, model):
        self.modules = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]

    def __enter__(self):
        for m in self.modules:
            m.set_requires_gradient_sync(False, recurse=False)

    def __exit__(self, *exc):
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False)


def owners_of(params: list[nn.Parameter], prepared: list[ModelParts]) -> list[ModelParts]:
    """The parts of ``prepared`` that hold any of ``params``; a ValueError if one of ``params``
    belongs to none of them (a model the accelerator did not prepare)."""
    chosen = {id(p) for p in params}
    owners = [parts for parts in prepared if any(id(p) in chosen for p in parts.parameters())]
    known = {id(p) for parts in owners for p in parts.parameters()}
    stray = [p for p in params if id(p) not in known]
    if stray:
        raise ValueError(
            f"clip_grad_norm_ got {len(stray)} parameter(s) of no model prepared by this accelerator; pass "
            "model.parameters() of the prepared model"
        )
    return owners
