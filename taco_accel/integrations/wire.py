"""The wire-header errors of a training step, raised at the optimizer step that would use them.

A compressed collective compares every chunk header it receives on the chunk's device, without a
host sync (`codec.api.compare_headers`): a chunk of another config or message length reads as
NaN and is flagged in its site's record. `StepWire` reads the flags of every model an
accelerator laid out once per optimizer step, before the optimizer uses the step's gradients,
on every rank, in a host read the step makes anyway where it makes one:

- after ``clip_grad_norm_`` (no gradient scaler): the flags ride in the norm's all-reduce, summed
  over every rank (`fold`), and are read at the optimizer step (`before_step`) or with the
  figures a training loop reads anyway (`read_with`: the recipes' loops);
- under fp16: the gradient scaler's overflow all-reduce carries them and its own read of the
  overflow flag is the step's read (`parallel.grad_scaler.MeshGradScaler`, `after_step`);
- neither: one all-reduce of the flag over every rank, where the accelerator's compression
  settings may compress (a decision every rank makes alike), and its read, at the step.

Every rank then raises the same `WireFormatError` (the ranks of other tensor-parallel groups,
which received no such chunk, too: the flag is summed over every rank), naming the site where
this rank received the chunk. Collectives outside a step (an evaluation) are read at the next.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.stats import WireCheck


class StepWire:
    """The wire-header check of one accelerator's training steps (see the module doc).

    ``ledgers()``: the statistics ledgers of the models laid out (read at each check);
    ``device``: where the flag lives (the collectives' device); ``world``: the processes;
    ``compresses``: whether the accelerator's settings may compress any collective (the same on
    every rank); ``scaler``: the fp16 `MeshGradScaler`, which carries the check itself, or None."""

    def __init__(self, ledgers: Callable[[], list], device: torch.device, world: int, compresses: bool,
                 scaler=None) -> None:
        self.ledgers, self.device, self.world, self.compresses, self.scaler = ledgers, device, world, compresses, scaler
        self._folded: tuple[WireCheck, torch.Tensor] | None = None  # the check clip_grad_norm_ summed over ranks
        self._read = False  # a training loop read this step's check already (`read_with`)
        if scaler is not None:
            scaler.wire_check = self.check

    def check(self) -> WireCheck:
        """The flags compared since their last read, as one `WireCheck`."""
        return WireCheck(self.ledgers(), self.device)

    def fold(self) -> torch.Tensor | None:
        """The flag for ``clip_grad_norm_`` to sum over every rank in the norm's all-reduce (None
        under fp16: the scaler carries it; None where the settings compress nothing: no chunk can
        carry another header, and the step reads no flag)."""
        if self.scaler is not None or not self.compresses:
            return None
        check = self.check()
        self._folded = (check, check.flag)
        return check.flag

    def before_step(self) -> None:
        """Before the optimizer step: raise the step's wire errors on every rank (one host read),
        unless the scaler (fp16) or the training loop (`read_with`) reads them."""
        if self.scaler is not None or self._consume_read():
            return
        check, flag = self._take()
        if flag is not None:
            check.settle(bool(flag))  # the step's one host read

    def after_step(self, skipped: bool) -> None:
        """After an fp16 optimizer step: the scaler's verdict (`MeshGradScaler.settle_wire`)."""
        if self.scaler is not None:
            self.scaler.settle_wire(skipped)

    def read_with(self, values: torch.Tensor) -> list[float]:
        """``values`` (a 1-D tensor a training loop reads every step, on this device) as floats,
        read to the host together with the step's wire flag in one transfer: a `WireFormatError`
        on every rank if a chunk of the step's collectives had another header. Call it after
        ``clip_grad_norm_`` and before the optimizer step, which then reads nothing again."""
        if self.scaler is not None:
            return values.tolist()
        check, flag = self._take()
        self._read = True
        if flag is None:
            return values.tolist()
        out = torch.cat([values.view(-1), flag.to(values).view(1)]).tolist()
        check.settle(out.pop() > 0)
        return out

    def step_done(self) -> None:
        """The optimizer stepped (or zeroed the gradients): the next check is the next step's."""
        self._read = False

    def _consume_read(self) -> bool:
        read, self._read = self._read, False
        return read

    def _take(self) -> tuple[WireCheck, torch.Tensor | None]:
        """The step's check and its flag to read (summed over every rank), or a None flag where
        nothing is to be read: clip_grad_norm_'s, else a new check, summed over every rank where
        the settings may compress, read locally where one process compared flags."""
        folded, self._folded = self._folded, None
        if folded is not None:
            return folded
        check = self.check()
        if self.world > 1 and self.compresses:
            dist.all_reduce(check.flag)
            return check, check.flag
        return check, None if check.empty else check.flag
