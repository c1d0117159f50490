"""FSDP2 over dp composed with TP and sequence parallelism (4 gloo ranks: dp=2 x tp=2).

FSDP2 replaces parameter objects, so the gradient-sum hooks `parallelize` puts on replicated
parameters that see part of the data (norms on sequence shards) never fire under it; the
trainer sums those gradients itself (`ReplicaGradSum`). Without that, the norm weights of the
two TP ranks drift apart (0.048 after 3 steps here) while the loss looks plausible.
"""

from __future__ import annotations

import pytest

from harness import run_ranks
from test_pipeline import STEPS, TOL, reference


def _fsdp_tp_sp(out: str, cache: str):
    import torch
    import torch.distributed as dist

    from taco_accel.integrations import TrainConfig, Trainer

    cfg = TrainConfig(family="qwen2", preset="nano", seq_len=32, micro_batch_size=2, micro_batches=2, steps=STEPS,
                      lr=1e-2, warmup_steps=1, eval_every=0, trackers=(), progress=False, export=False, plot=False,
                      compression=None, output_dir=out, cache_dir=cache, device="cpu", pp=1, dp=2, tp=2,
                      dp_mode="fsdp", sequence_parallel=True)
    trainer = Trainer(cfg)
    losses = [row["loss"] for row in trainer.train()]
    worst = 0.0  # replicated norm weights must stay identical on the TP ranks
    for stage in trainer.plan.modules:
        for name, p in stage.named_parameters():
            if "norm" in name:
                local = (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous()
                both = [torch.empty_like(local) for _ in range(2)]
                dist.all_gather(both, local, group=trainer.mesh["tp"].get_group())
                worst = max(worst, (both[0] - both[1]).abs().max().item())
    return losses, worst


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("fsdp_tp"), tmp_path_factory.mktemp("cache")
    return run_ranks(_fsdp_tp_sp, 4, str(out), str(cache)), str(cache)


def test_replicated_norms_stay_identical_across_tp_ranks(fsdp_tp):
    ranks, _ = fsdp_tp
    assert max(worst for _, worst in ranks) == 0.0


def test_fsdp_tp_sequence_parallel_matches_single_process(fsdp_tp):
    ranks, cache = fsdp_tp
    expect = reference(cache, dp=2)
    assert max(abs(a - b) for a, b in zip(ranks[0][0], expect)) < TOL
