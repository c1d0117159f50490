"""When a `taco_accel.Accelerator` reduces gradients: once per optimizer step, after the last
backward, so that accumulation needs no communication.

- `StepOptimizer`: Accelerate's optimizer wrapper whose real step first reduces the step's
  gradients over the mesh (unless clipping already has), raises the step's wire-header errors
  (`wire.StepWire`) and then opens the next step;
- `FsdpNoSync`: ``no_sync`` for such models: FSDP2 modules skip their per-micro-batch
  reduce-scatter; the others have nothing to skip.
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer


class StepOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose real steps first reduce the step's gradients (if
    clipping has not), raise a wire-header error of the step's collectives on every rank before
    the optimizer uses them (``wire``: the accelerator's `wire.StepWire`), and then open the next
    step (``done``)."""

    def __init__(self, optimizer, finish, done, wire, **kwargs):
        super().__init__(optimizer, **kwargs)
        self._finish, self._done, self._wire = finish, done, wire
        self.steps = 0  # optimizer steps taken (not skipped): the training step a checkpoint records

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return super().step(closure)
        self._finish()
        try:
            self._wire.before_step()
            out = super().step(closure)
            self._wire.after_step(self.step_was_skipped)
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
