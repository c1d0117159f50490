"""Statistics per model: two parallel models in one process (a policy and its reference, an EMA
copy) keep separate counts, and each consumer reads only its own model's (`Accelerator.
compression_stats(model)`, the training loops' `comm_totals`; a model it did not prepare is
refused); a link and its workspaces go with their process group."""

from __future__ import annotations

import gc
import weakref

from harness import run_ranks


def _two_models() -> dict:
    import torch

    import taco_accel
    from accelerate_loop_worker import DATA, fresh_model
    from taco_accel import ParallelDims
    from taco_accel.training.loop import comm_totals

    acc = taco_accel.Accelerator(parallel_dims=ParallelDims(tp=2), compression="on")
    policy, reference = acc.prepare(fresh_model()), acc.prepare(fresh_model(1))
    ids = DATA[:2]
    acc.compression_stats()  # both start from zero
    policy(input_ids=ids).logits.sum().backward()  # the policy alone: forward and backward
    with torch.no_grad():
        reference(input_ids=ids)  # the reference: forward only, fewer bytes
    out = {"reference": acc.compression_stats(model=reference)}  # the reference's alone ...
    out["policy"] = acc.compression_stats(model=policy)  # ... left the policy's figures in place
    out["again"] = acc.compression_stats()  # every figure was read: nothing since
    with torch.no_grad():
        reference(input_ids=ids)
    out["totals"] = (comm_totals(acc.comm_ledgers(policy)), comm_totals(acc.comm_ledgers(reference)))
    try:  # refused on every rank before any collective
        acc.compression_stats(model=fresh_model(2))
        out["stranger"] = None
    except ValueError as e:
        out["stranger"] = str(e)
    return out


def test_two_models_in_one_process_keep_separate_counts():
    for got in run_ranks(_two_models, 2):
        reference, policy = got["reference"], got["policy"]
        assert reference["comm/bytes_sent"] > 0 and policy["comm/bytes_sent"] > 0, got
        # the policy ran a forward and a backward of the same shapes, the reference a forward only:
        # each figure is its own model's (a process-wide pop would give the first reader both)
        assert policy["comm/bytes_sent"] > reference["comm/bytes_sent"], got
        assert policy["comm/compression"] > 1 and reference["comm/compression"] > 1, got  # "on": compressed
        assert got["again"]["comm/bytes_sent"] == 0, got
        policy_totals, reference_totals = got["totals"]
        assert sum(policy_totals) == 0 and sum(reference_totals) > 0, got
        assert "not prepared by this Accelerator" in (got["stranger"] or ""), got  # a model it never saw


def _link_released() -> dict:
    import torch
    import torch.distributed as dist

    from taco_accel import comm
    from taco_accel.comm import dist_ops

    group = dist.new_group([0, 1])
    site = comm.Site("s", group, comm.Compression().forward)
    site.run("all_reduce", torch.ones(4096))  # compressed: the link's workspace holds its buffers
    link = weakref.ref(site.link)
    workspaces = len(site.link.workspaces)
    del site
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return {"workspaces": workspaces, "released": link() is None, "links": len(dist_ops._links)}


def test_a_link_and_its_workspaces_go_with_their_group():
    for got in run_ranks(_link_released, 2):
        assert got["workspaces"] == 1 and got["released"], got
