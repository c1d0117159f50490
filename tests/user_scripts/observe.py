"""Run a user's training script unchanged and record what a test compares with one process.

The script runs as ``__main__`` through ``runpy``, as ``python script.py ARGS`` would run it,
after its ``from taco_accel import Accelerator`` has been pointed at a subclass that only
observes: per optimizer step the learning rate the step uses and the losses of its
micro-batches (``outputs.loss`` of every training forward), and every log line and
``accelerator.print``. Nothing in the script changes; the records go to a JSON file per rank.

    accelerate launch --config_file CFG tests/user_scripts/observe.py RUN [--next RUN2 ...]
        -> OUT.rank<r>.json per run on every rank, with taco_accel's Accelerator
    python tests/user_scripts/observe.py --reference RUN [--next RUN2 ...]
        -> OUT.rank0.json per run, one process, with Accelerate's own Accelerator (the reference)

    RUN = [--compression=on|off] OUT SCRIPT [ARGS...]

The runs go one after the other in the same processes, each with a fresh Accelerator as a new
process would have (Accelerate's state reset between them). ``--compression`` (default
``off``) is the compression taco_accel's Accelerator gets (a script's own default, ``"auto"``,
decides by timing: not reproducible in a test).
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
import traceback

import torch

COMPRESSION = "off"  # of the run in progress


class Record(logging.Handler):
    """What one run did on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.steps: list[dict] = []  # per optimizer step: {"lr": ..., "losses": [micro-batch losses]}
        self.micro: list[float] = []
        self.log: list[str] = []
        self.info: dict = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.log.append(record.getMessage())

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({**self.info, "steps": self.steps, "log": self.log}, f)


RECORD = Record()


def _observer(base):
    """``base`` (an Accelerator class) whose ``prepare`` attaches the observation hooks."""

    class Observed(base):
        def __init__(self, *args, **kwargs):
            if base.__module__.startswith("taco_accel"):
                import taco_accel

                kwargs.setdefault("compression", None if COMPRESSION == "off" else
                                  taco_accel.TacoConfig(group_size=32))
            super().__init__(*args, **kwargs)
            RECORD.info.update(rank=self.state.process_index, world=self.state.num_processes,
                               num_processes=self.num_processes, process_index=self.process_index)

        def prepare(self, *args, **kwargs):
            from accelerate.optimizer import AcceleratedOptimizer

            out = super().prepare(*args, **kwargs)
            for obj in out if isinstance(out, tuple) else (out,):
                if isinstance(obj, AcceleratedOptimizer):
                    self._watch_steps(obj)
                elif isinstance(obj, torch.nn.Module):
                    self.unwrap_model(obj).register_forward_hook(_record_loss, with_kwargs=True)
            return out

        def _watch_steps(self, optimizer) -> None:
            step = optimizer.step

            def observed_step(*args, **kwargs):
                if self.sync_gradients:
                    RECORD.steps.append({"lr": optimizer.optimizer.param_groups[0]["lr"], "losses": RECORD.micro})
                    RECORD.micro = []
                return step(*args, **kwargs)

            optimizer.step = observed_step

        def print(self, *args, **kwargs):
            RECORD.log.append(" ".join(str(a) for a in args))
            return super().print(*args, **kwargs)

    return Observed


def _record_loss(module, args, kwargs, output) -> None:
    loss = getattr(output, "loss", None)
    if module.training and torch.is_grad_enabled() and loss is not None:
        RECORD.micro.append(float(loss.detach()))


def run(script: str, argv: list[str], out: str, reference: bool, compression: str = "off") -> None:
    """Run ``script`` with ``argv`` as ``__main__``; its records (and the error, if it raised)
    go to ``OUT.rank<r>.json``."""
    import accelerate

    import taco_accel

    global RECORD, COMPRESSION
    RECORD, COMPRESSION = Record(), compression
    logging.getLogger().addHandler(RECORD)
    original = taco_accel.Accelerator
    taco_accel.Accelerator = _observer(accelerate.Accelerator if reference else original)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        RECORD.info["error"] = traceback.format_exc()
        raise
    finally:
        taco_accel.Accelerator = original
        logging.getLogger().removeHandler(RECORD)
        RECORD.write(f"{out}.rank{RECORD.info.get('rank', 0)}.json")


def main() -> None:
    from accelerate.state import AcceleratorState, GradientState

    args = sys.argv[1:]
    reference = args[:1] == ["--reference"]
    runs, current = [], []
    for arg in args[1:] if reference else args:
        if arg == "--next":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    for spec in runs:  # one failing run leaves its error in its file; the next still runs
        compression = "off"
        if spec[0].startswith("--compression="):
            compression = spec.pop(0).partition("=")[2]
        out, script, *argv = spec
        try:
            run(script, argv, out, reference, compression)
        except Exception:  # noqa: BLE001 - recorded in the run's file
            pass
        AcceleratorState._reset_state(True)  # the next run starts a fresh Accelerator, as a new process would
        GradientState._reset_state()


if __name__ == "__main__":
    main()
