"""The one multi-rank test harness: run a function on N gloo ranks, each its own process.

Every distributed test calls `run_ranks`. The worker must be a module-level function (it is
pickled by reference); its return values come back as a list indexed by rank, and an exception
on any rank fails the test with that rank's traceback.

Several cases in one launch (one start-up, one model build shared): the worker runs them through
`per_case`, which keeps each case's value or error apart, and each test takes its own case's
values with `case`, which fails that test alone with the rank's traceback. A case that raises on
every rank (a library error) leaves the others intact; one that raises on some ranks only can
leave its peers waiting in a collective, and then the launch's timeout fails the whole file.

Ranks keep their tensors on the CPU, over gloo, on a GPU box too: conftest.py sets
``ACCELERATE_USE_CPU`` for the session, which every rank inherits.

Ranks start from a fork server that has already imported torch, transformers' model modules
and taco_accel (about 0.1 s per launch instead of several seconds for a fresh interpreter). ``env`` is applied in each rank before ``fn`` runs, i.e.
after torch was imported: a variable that torch reads at import time must be set before the
first `run_ranks` call, or set ``TACO_TEST_START_METHOD=spawn`` for fresh interpreters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240
# imported once in the fork server, so that ranks start with them loaded (several seconds per
# launch for transformers and its model modules)
_PRELOAD = [
    "torch", "torch.distributed", "transformers",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama", "transformers.models.mistral.modeling_mistral",
    "transformers.models.gpt2.modeling_gpt2", "taco_accel",
]


def _context():
    method = os.environ.get("TACO_TEST_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


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
        # by value: a tensor put as is travels as a shared-memory fd that the parent fetches from
        # this process later, and fails ("Connection reset by peer") once this process has exited
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, procs, timeout: float, outputs: dict, errors: dict) -> None:
    """Fill ``outputs`` / ``errors`` from the ranks' reports; stop at the first error.

    A rank that dies without reporting (a crash at start-up, a segfault) fails the run at once
    instead of after the full timeout.
    """
    deadline = time.monotonic() + timeout
    while len(outputs) < len(procs) and not errors:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                errors.update({r: f"exited with code {procs[r].exitcode} before reporting" for r in dead})
            elif time.monotonic() > deadline:
                errors[-1] = f"timed out after {timeout}s waiting for {len(procs) - len(outputs)} rank(s)"
            continue
        (outputs if status == "ok" else errors)[rank] = value  # on an error, the other ranks are
        # likely blocked in a collective: stop waiting for them


def per_case(cases: Mapping[Hashable, Callable[[], Any]]) -> dict:
    """In a rank: run every case (a callable without arguments) in order; ``{key: (ok, value or
    traceback)}`` for `case` to unpack, an exception of one case kept as that case's result."""
    out = {}
    for key, run in cases.items():
        try:
            out[key] = (True, run())
        except Exception:  # the case's own failure, reported by its own test
            out[key] = (False, traceback.format_exc())
    return out


def refusals(calls: Mapping[Hashable, Callable[[], Any]], error: type[Exception] = ValueError) -> dict:
    """In a rank: ``{key: the message of the ``error`` the call raised, or None where it did not
    raise}``, for tests of what an entry point refuses (any other exception propagates)."""
    out = {}
    for key, call in calls.items():
        try:
            call()
            out[key] = None
        except error as e:
            out[key] = str(e)
    return out


def case(results: list, key: Hashable) -> list:
    """The values of case ``key`` on every rank (``results``: `run_ranks` of a `per_case` worker);
    an AssertionError with the rank's traceback where the case raised."""
    failed = [(rank, r[key][1]) for rank, r in enumerate(results) if not r[key][0]]
    if failed:
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in failed)
        raise AssertionError(f"case {key!r} raised on {len(failed)} rank(s):\n{report}")
    return [r[key][1] for r in results]


UNIT = 2.0**-24  # fp32 unit roundoff


def lm_batch(vocab: int, seed: int = 1):
    """``(input_ids, labels)`` of shape (2, 8): random ids below ``vocab``, the labels the ids with
    the first two positions of row 0 ignored (-100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def fp32_bound(terms: int, magnitude: float) -> float:
    """How far two fp32 evaluations, in any order, of one sum of ``terms`` terms whose
    magnitudes add up to ``magnitude`` can differ: each is within gamma_n * magnitude of the exact
    sum (gamma_n = n u / (1 - n u), u = 2**-24), whatever the order, thread count or vector width."""
    gamma = terms * UNIT / (1 - terms * UNIT)
    return 2 * gamma * magnitude


# a tiny model (taco_accel.models.tiny_model: hidden 64, MLP 128, vocabulary 128-130, 16 tokens)
# against the same model another way (over ranks, emulated, fused, reloaded), the same products
# with their sums split or reordered: sums of at most 256 terms (the MLP's inner size; 16 tokens of
# a weight gradient; the head's input gradient over the vocabulary) whose magnitudes add up to a
# few units in these models
TINY_MODEL_FP32 = fp32_bound(256, 10.0)


# the chunked functions of the head and loss (`taco_accel.models.loss`), by path: the fused head and
# loss, TRL's per-token log-probabilities, the loss over given logits
LOSS_PATHS = {"fused": ("taco_accel.tp.fused_cross_entropy", "_loss_and_grads"),
              "log_probs": ("taco_accel.tp.fused_cross_entropy", "_token_stats"),
              "logits": ("taco_accel.tp.cross_entropy", "_logits_loss")}


@contextlib.contextmanager
def loss_paths():
    """Inside, ``{path: calls}`` of each chunked function of `LOSS_PATHS` (forwards that took it). The
    functions run as they are; only their calls are counted."""
    import importlib

    counts = dict.fromkeys(LOSS_PATHS, 0)
    originals = {}
    for path, (module_name, name) in LOSS_PATHS.items():
        module = importlib.import_module(module_name)
        originals[path] = (module, name, getattr(module, name))

        def counted(*args, _path=path, _function=originals[path][2], **kwargs):
            counts[_path] += 1
            return _function(*args, **kwargs)

        setattr(module, name, counted)
    try:
        yield counts
    finally:
        for module, name, function in originals.values():
            setattr(module, name, function)


@contextlib.contextmanager
def timed_verdicts(rule: Callable[[str, Any, Any], bool]):
    """In a rank: the auto compression mode's timings (`comm.autotune.AutoDecider.timer`, its
    injection point) still run, but their verdict is ``rule(kind, x, config)`` (True:
    compressed), so that a test takes the code path it chooses whatever the machine's speed."""
    from taco_accel.comm.autotune import AutoDecider, time_collective

    def fixed(kind, x, group, config, *args, **kwargs):
        timing = time_collective(kind, x, group, config, *args, **kwargs)
        compress = bool(rule(kind, x, config))
        return dataclasses.replace(timing, plain_s=1e-3, compressed_s=0.5e-3 if compress else 2e-3, compress=compress)

    AutoDecider.timer = staticmethod(fixed)
    try:
        yield
    finally:
        AutoDecider.timer = staticmethod(time_collective)


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = _context()
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
            _collect(results, procs, timeout, outputs, errors)
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} rank(s) failed:\n{report}")
    return [pickle.loads(outputs[r]) for r in range(world_size)]


def run_command(cmd: list[str], *, env: dict | None = None, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own: a launch
    that outlives ``timeout`` is killed with every process it started (``accelerate launch`` and
    ``torchrun`` ranks survive their launcher's kill otherwise, and keep the machine's cores
    busy for the rest of the suite), then the test fails with what it printed."""
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(map(str, cmd[:6]))} ... timed out after {timeout}s:\n"
                                 f"{out[-3000:]}{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_command(cmd: list[str], *, env: dict | None = None, cwd=None) -> subprocess.Popen:
    """A background ``Popen`` (stdout and stderr together) in a session of its own; end it with
    `finish_command`, which kills its whole session if it outlives the timeout."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish_command(proc: subprocess.Popen, timeout: float = 600) -> str:
    """What a `start_command` process printed once it ended; killed with its session after ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out = proc.communicate()[0]
        raise AssertionError(f"{' '.join(map(str, proc.args[:6]))} ... timed out after {timeout}s:\n{out[-6000:]}") from None


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``proc``'s session (it was started with ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def random_tokens_trainer(vocab: int, train: int, val: int, seed: int = 11) -> type:
    """The recipes' pretraining `Trainer` on random token streams (its ``load_tokens`` hook):
    ``train`` training and ``val`` validation tokens below ``vocab``, the byte tokenizer."""
    import torch

    from taco_accel.data import build_tokenizer
    from taco_accel.training import Trainer

    class RandomTokens(Trainer):
        def load_tokens(self):
            g = torch.Generator().manual_seed(seed)
            return build_tokenizer("byte"), torch.randint(0, vocab, (train,), generator=g), \
                torch.randint(0, vocab, (val,), generator=g)

    return RandomTokens
