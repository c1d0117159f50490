"""The one multi-rank test harness: run a function on N gloo ranks, each its own process.

Every distributed test calls `run_ranks`. The worker must be a module-level function (it is
pickled by reference); its return values come back as a list indexed by rank, and an exception
on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240


def _entry(fn, rank, world_size, init_file, results, env, args, kwargs):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N ranks share the machine's few cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", **(env or {})}
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init_file, results, env, args, kwargs), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs, errors = {}, {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout)
                (outputs if status == "ok" else errors)[rank] = value
                if errors:
                    break  # the other ranks are likely blocked in a collective
        except queue.Empty:
            errors[-1] = f"timed out after {timeout}s waiting for {world_size - len(outputs)} rank(s)"
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} rank(s) failed:\n{report}")
    return [outputs[r] for r in range(world_size)]
