"""dp=2 x pp=2 x tp=2 on 8 gloo ranks (the nano Qwen2 preset, 3 steps) against one process:
equal losses with plain TP collectives, close ones with TACO-compressed collectives."""

from __future__ import annotations

import os

import pytest

from harness import run_ranks
from test_pipeline import STEPS, TOL, reference, train_losses


def _three_d(out: str, cache: str) -> dict:
    from taco_accel import TacoConfig

    mesh = dict(dp=2, pp=2, tp=2, micro_batches=2)
    plain = train_losses(os.path.join(out, "plain"), cache, **mesh)
    # threshold 0: the nano model's messages are tiny, compress them all; G=32 divides h=32
    taco = train_losses(os.path.join(out, "taco"), cache, compression=TacoConfig(group_size=32, threshold_bytes=0),
                        **mesh)
    sequence = train_losses(os.path.join(out, "sp"), cache, sequence_parallel=True, **mesh)
    return {"plain": plain, "taco": taco, "sequence_parallel": sequence}


@pytest.fixture(scope="module")
def three_d(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("3d"), tmp_path_factory.mktemp("cache3d")
    ranks = run_ranks(_three_d, 8, str(out), str(cache))
    assert all(r == ranks[0] for r in ranks)
    return ranks[0], str(cache)


@pytest.mark.parametrize("name", ["plain", "sequence_parallel"])
def test_3d_plain_equals_single_process(three_d, name):
    results, cache = three_d
    assert len(results[name]) == STEPS
    assert results[name] == pytest.approx(reference(cache, dp=2), abs=TOL)


def test_3d_compressed_is_close_to_single_process(three_d):
    results, cache = three_d
    ref = reference(cache, dp=2)
    assert results["taco"][0] == pytest.approx(ref[0], rel=5e-3)  # step 1: only the forward differs
    assert results["taco"] == pytest.approx(ref, rel=2e-2)
    assert results["taco"] != pytest.approx(ref, abs=1e-7)  # the codec really ran
