"""Pipeline schedules, data parallelism, tied embeddings across stages and resume, on 2 gloo
ranks, against a single-process run on the same data (the nano Qwen2 / GPT-2 presets)."""

from __future__ import annotations

import functools
import os

import pytest

from harness import case, per_case, run_ranks

STEPS = 3
# fp32 losses (about 6) after 3 AdamW steps: the runs differ only in the order of fp32 sums, a few
# 2**-24 of each sum's magnitudes; Adam can turn such a rounding of a near-zero gradient element
# into a full step of that weight, but the loss does not feel it (its gradient there is ~0)
TOL = 2e-5


def trainer(out: str, cache: str, steps: int = STEPS, **overrides):
    """The recipes' `Trainer` of the nano preset for ``steps`` steps (compression off unless
    ``overrides`` say otherwise)."""
    from taco_accel.training import TrainConfig, Trainer

    values = dict(family="qwen2", preset="nano", seq_len=32, micro_batch_size=2, micro_batches=2, steps=steps,
                  lr=1e-2, warmup_steps=1, eval_every=0, trackers=(), progress=False, export=False, plot=False,
                  compression=None, output_dir=out, cache_dir=cache, device="cpu")
    values.update(overrides)
    return Trainer(TrainConfig(**values))


def train_losses(out: str, cache: str, steps: int = STEPS, until: int | None = None, **overrides) -> list[float]:
    """Train the nano preset for ``steps`` steps (stop after ``until``); the losses (the same
    on every rank)."""
    return [row["loss"] for row in trainer(out, cache, steps, **overrides).train(until)]


def _reference(cache: str, family: str, dp: int, steps: int) -> tuple[float, ...]:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        return tuple(train_losses(out, cache, steps, family=family, pp=1, dp=1, tp=1, micro_batches=2 * dp))


@functools.lru_cache(maxsize=None)
def reference(cache: str, family: str = "qwen2", dp: int = 1, steps: int = STEPS) -> tuple[float, ...]:
    """The same training in one process (pp = tp = 1, the same global batch), run as a rank of
    its own: one thread, as the ranks it is compared with, whatever this machine's core count."""
    return run_ranks(_reference, 1, cache, family, dp, steps)[0]


CASES = {
    "gpipe": dict(pp=2, schedule="gpipe"),
    "1f1b": dict(pp=2, schedule="1f1b"),
    "interleaved_1f1b": dict(pp=2, schedule="interleaved_1f1b"),  # 2 stages per rank, 4 in all
    "gpt2_tied_pp2": dict(family="gpt2", pp=2, schedule="1f1b"),
    "ddp": dict(dp=2, micro_batches=2),
    "fsdp": dict(dp=2, dp_mode="fsdp", micro_batches=2),
    "tp2": dict(tp=2),
    "tp2_sequence_parallel": dict(tp=2, sequence_parallel=True),
}

RESUME_CASES = {"pp2": dict(pp=2), "tp2": dict(tp=2), "fsdp": dict(dp=2, dp_mode="fsdp")}


def _case(out: str, cache: str, name: str, overrides: dict) -> list[float]:
    import torch.distributed as dist

    losses = train_losses(os.path.join(out, name), cache, **overrides)
    dist.barrier()
    return losses


def _resume_case(out: str, cache: str, name: str, mesh: dict) -> tuple:
    """4 steps straight vs a run stopped after step 2 (checkpoint every 2), then a new run
    resuming from it to step 4; Adam moments, LR schedule and data position carry over."""
    path = os.path.join(out, f"resume_{name}")
    straight = train_losses(path + "_straight", cache, steps=4, **mesh)
    first = train_losses(path, cache, steps=4, until=2, save_every=2, **mesh)
    resumed = train_losses(path, cache, steps=4, resume="latest", **mesh)
    return straight, first, resumed


def _two_rank_suite(out: str, cache: str) -> dict:
    cases = {name: functools.partial(_case, out, cache, name, overrides) for name, overrides in CASES.items()}
    cases.update({f"resume_{name}": functools.partial(_resume_case, out, cache, name, mesh)
                  for name, mesh in RESUME_CASES.items()})
    return per_case(cases)


@pytest.fixture(scope="module")
def suite(tmp_path_factory, token_cache):
    out = tmp_path_factory.mktemp("pp_out")
    return run_ranks(_two_rank_suite, 2, str(out), token_cache), token_cache


def losses(suite, name: str):
    """Case ``name``'s losses: the same reduced values on every rank."""
    ranks = case(suite[0], name)
    assert all(r == ranks[0] for r in ranks), ranks
    return ranks[0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_schedule_matches_single_process(suite, name):
    # bit for bit: each stage runs the one process's operations in its order, and with compression
    # off the stage boundaries send the very tensors (taco_accel.parallel.boundary)
    assert losses(suite, name) == list(reference(suite[1]))


def test_tied_embedding_across_stages_matches_single_process(suite):
    assert losses(suite, "gpt2_tied_pp2") == pytest.approx(reference(suite[1], "gpt2"), abs=TOL)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(suite, name):
    assert losses(suite, name) == pytest.approx(reference(suite[1], dp=2), abs=TOL)


@pytest.mark.parametrize("name", ["tp2", "tp2_sequence_parallel"])
def test_tensor_parallel_matches_single_process(suite, name):
    assert losses(suite, name) == pytest.approx(reference(suite[1]), abs=TOL)


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_repeats_the_uninterrupted_losses(suite, name):
    straight, first, resumed = losses(suite, f"resume_{name}")
    assert first == straight[:2]
    assert resumed == straight  # the history comes back with the checkpoint; steps 3-4 are new
