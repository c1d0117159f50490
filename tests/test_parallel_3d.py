"""dp=2 x pp=2 x tp=2 on 8 gloo ranks (the nano Qwen2 preset, 3 steps) against one process:
equal losses with plain TP collectives, close ones with TACO-compressed collectives, with a
compressed data-parallel gradient reduction (``grad_compression``; its bounds and error feedback:
test_grad_compression), and with the pipeline stage boundaries compressed alone
(test_pipeline_boundaries.py checks those bit for bit at pp=2, tp=1)."""

from __future__ import annotations

import functools
import os

import pytest

from harness import case, per_case, run_ranks
from test_pipeline import STEPS, TOL, reference, train_losses, trainer

MESH = dict(dp=2, pp=2, tp=2, micro_batches=2)


def _boundaries_only(out: str, cache: str, taco) -> dict:
    """TP plain, the pipeline boundaries compressed (the last matching pattern wins)."""
    import json

    import torch.distributed as dist

    from taco_accel import Compression

    compression = Compression("on", taco, taco, sites={"*": None, "pp.*": taco})
    rows = trainer(out, cache, compression=compression, **MESH).train()
    dist.barrier()  # the main rank wrote compression.json
    with open(os.path.join(out, "compression.json")) as f:
        decisions = json.load(f)
    return {"rows": [(r["loss"], r["comm_bytes_saved"]) for r in rows],
            "compressed": sorted(name for name, d in decisions.items() if d["compressed"]), "sites": len(decisions)}


def _three_d(out: str, cache: str) -> dict:
    from taco_accel import TacoConfig

    # threshold 0: the nano model's messages are tiny, compress them all; G=32 divides h=32
    taco = TacoConfig(group_size=32)
    return per_case({
        "plain": functools.partial(train_losses, os.path.join(out, "plain"), cache, **MESH),
        "taco": functools.partial(train_losses, os.path.join(out, "taco"), cache, compression=taco, **MESH),
        "sequence_parallel": functools.partial(train_losses, os.path.join(out, "sp"), cache, sequence_parallel=True,
                                               **MESH),
        "grad_compression": functools.partial(train_losses, os.path.join(out, "dp"), cache, grad_compression=taco,
                                              **MESH),
        "boundaries": functools.partial(_boundaries_only, os.path.join(out, "pp"), cache, taco),
    })


@pytest.fixture(scope="module")
def three_d(tmp_path_factory, token_cache):
    out = tmp_path_factory.mktemp("3d")
    return run_ranks(_three_d, 8, str(out), token_cache), token_cache


def _losses(three_d, name: str) -> list[float]:
    ranks = case(three_d[0], name)
    assert all(r == ranks[0] for r in ranks)  # every rank reports the same reduced losses
    return ranks[0]


@pytest.mark.parametrize("name", ["plain", "sequence_parallel"])
def test_3d_plain_equals_single_process(three_d, name):
    losses = _losses(three_d, name)
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference(three_d[1], dp=2), abs=TOL)


def test_3d_compressed_is_close_to_single_process(three_d):
    taco, ref = _losses(three_d, "taco"), reference(three_d[1], dp=2)
    # sanity bounds on the loss, as in test_parallelize's compressed parity (the per-message codec
    # bound is test_comm's): step 1, where only the forward differs, then AdamW on compressed gradients
    assert taco[0] == pytest.approx(ref[0], rel=5e-3)
    assert taco == pytest.approx(ref, rel=2e-2)
    assert taco != pytest.approx(ref, abs=1e-7)  # the codec really ran


def test_3d_compressed_gradients_are_close_to_single_process(three_d):
    dp, ref = _losses(three_d, "grad_compression"), reference(three_d[1], dp=2)
    assert dp[0] == pytest.approx(ref[0], abs=TOL)  # the first loss precedes any update
    # a sanity bound, as above: AdamW on gradients within the codec's bound (test_grad_compression)
    assert dp == pytest.approx(ref, rel=2e-2)
    assert dp != pytest.approx(ref, abs=1e-7)  # the codec really ran


def test_3d_with_compressed_boundaries_only_is_close_and_saves_their_bytes(three_d):
    from taco_accel.codec import TacoConfig, WireLayout

    run, ref = _losses(three_d, "boundaries"), reference(three_d[1], dp=2)
    rows = run["rows"]
    # compression.json: every site of every stage, the TP ones plain, the boundary's compressed
    assert run["compressed"] == ["pp.0-1/bwd", "pp.0-1/fwd"] and run["sites"] > 2
    message = 2 * 32 * 32  # a micro-batch's hidden states (2 windows of 32 tokens, h=32), fp32, on every tp rank
    wire = WireLayout.for_tensor(message, TacoConfig(group_size=32)).total_bytes
    # the TP collectives are plain (nothing saved): every byte saved is a boundary's, over the
    # 4 (dp, tp) links, both directions, 2 micro-batches per step
    assert [saved for _, saved in rows] == [4 * 2 * 2 * (4 * message - wire)] * STEPS
    losses = [loss for loss, _ in rows]
    # the sanity bounds of the compressed case above (one codec round trip per direction and cut)
    assert losses[0] == pytest.approx(ref[0], rel=5e-3)
    assert losses == pytest.approx(ref, rel=2e-2)
    assert losses != pytest.approx(ref, abs=1e-7)
