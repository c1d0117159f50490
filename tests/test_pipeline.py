"""Pipeline schedules, data parallelism, tied embeddings across stages and resume, on 2 gloo
ranks, against a single-process run on the same data (the nano Qwen2 / GPT-2 presets)."""

from __future__ import annotations

import functools
import os

import pytest

from harness import run_ranks

STEPS = 3
TOL = 2e-5  # fp32 losses: the runs differ only in the order of sums


def train_losses(out: str, cache: str, steps: int = STEPS, until: int | None = None, **overrides) -> list[float]:
    """Train the nano preset for ``steps`` steps (stop after ``until``); the losses (the same
    on every rank)."""
    from taco_accel.integrations import TrainConfig, Trainer

    values = dict(family="qwen2", preset="nano", seq_len=32, micro_batch_size=2, micro_batches=2, steps=steps,
                  lr=1e-2, warmup_steps=1, eval_every=0, trackers=(), progress=False, export=False, plot=False,
                  compression=None, output_dir=out, cache_dir=cache, device="cpu")
    values.update(overrides)
    return [row["loss"] for row in Trainer(TrainConfig(**values)).train(until)]


@functools.lru_cache(maxsize=None)
def reference(cache: str, family: str = "qwen2", dp: int = 1, steps: int = STEPS) -> tuple[float, ...]:
    """The same training in one process (pp = tp = 1, the same global batch)."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as out:
        try:
            return tuple(train_losses(out, cache, steps, family=family, pp=1, dp=1, tp=1, micro_batches=2 * dp))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


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


def _two_rank_suite(out: str, cache: str) -> dict:
    import torch.distributed as dist

    results = {}
    for name, overrides in CASES.items():
        results[name] = train_losses(os.path.join(out, name), cache, **overrides)
        dist.barrier()
    # resume: 4 steps straight vs a run stopped after step 2 (checkpoint every 2), then a new
    # run resuming from it to step 4; Adam moments, LR schedule and data position carry over
    for name, mesh in RESUME_CASES.items():
        path = os.path.join(out, f"resume_{name}")
        straight = train_losses(path + "_straight", cache, steps=4, **mesh)
        first = train_losses(path, cache, steps=4, until=2, save_every=2, **mesh)
        resumed = train_losses(path, cache, steps=4, resume="latest", **mesh)
        results[f"resume_{name}"] = (straight, first, resumed)
    return results


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("pp_out"), tmp_path_factory.mktemp("cache")
    ranks = run_ranks(_two_rank_suite, 2, str(out), str(cache))
    assert ranks[0] == ranks[1]  # every rank reports the same reduced losses
    return ranks[0], str(cache)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_schedule_matches_single_process(suite, name):
    results, cache = suite
    assert results[name] == pytest.approx(reference(cache), abs=TOL)


def test_tied_embedding_across_stages_matches_single_process(suite):
    results, cache = suite
    assert results["gpt2_tied_pp2"] == pytest.approx(reference(cache, "gpt2"), abs=TOL)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(suite, name):
    results, cache = suite
    assert results[name] == pytest.approx(reference(cache, dp=2), abs=TOL)


@pytest.mark.parametrize("name", ["tp2", "tp2_sequence_parallel"])
def test_tensor_parallel_matches_single_process(suite, name):
    results, cache = suite
    assert results[name] == pytest.approx(reference(cache), abs=TOL)


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_repeats_the_uninterrupted_losses(suite, name):
    straight, first, resumed = suite[0][f"resume_{name}"]
    assert first == straight[:2]
    assert resumed == straight  # the history comes back with the checkpoint; steps 3-4 are new
