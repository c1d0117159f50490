"""What every rank of a launched run does together: the rank-0-first pattern, a failure left
for the launcher's summary, the trackers that are installed.

The run classes (`Trainer`, `Finetuner`) and the recipes' command lines use these; how
``accelerate launch`` hands a process its sizes is `taco_accel.integrations.launch`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)


def global_rank() -> int:
    """This process's rank: torch.distributed's, else the launcher's RANK (before the group exists)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def main_first(fn):
    """``fn()`` on global rank 0, then on the other ranks (downloads, tokenizers and caches are
    made once, then read); every rank returns its own result. If it raises on rank 0, every
    rank raises that error (the others do not wait for a result that never comes)."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            error = e
    if dist.is_initialized():
        box = [_portable(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise error if error is not None else box[0]
    elif error is not None:
        raise error
    if not is_main:
        result = fn()
    return result


def _portable(error: Exception | None):
    """``error`` if it survives pickling (to go to the other ranks), else a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def record_failure(message: str) -> None:
    """Leave ``message`` where torchrun's (and ``accelerate launch``'s) failure summary reads it:
    the ``TORCHELASTIC_ERROR_FILE`` of this process, so that the summary shows the cause
    instead of a pointer to the docs. Nothing without a launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    except OSError:  # a summary without the cause, as before
        pass


def usable_trackers(names) -> list[str]:
    """The Accelerate tracker names whose package is installed (the others dropped with a warning)."""
    usable = []
    for name in names:
        module = {"tensorboard": "torch.utils.tensorboard"}.get(name, name)
        try:
            __import__(module)
            usable.append(name)
        except ImportError:
            logger.warning("tracker %r is not installed; logging without it", name)
    return usable
