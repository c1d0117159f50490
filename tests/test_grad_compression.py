"""The compressed data-parallel gradient reduction (``grad_compression``): DDP replicas (dp=2) and
FSDP2 (dp=2 x tp=2) on gloo ranks, against one process; its error feedback; resume; agreement.

Bounds. One encoding moves a group of G values by at most eps of its 2-norm (`worst_case_error`
of test_codec: 2**-4 for E4M3 plus the subnormal and fp32 terms), so a message by at most eps of
its norm. On the first step every residual is zero, so the reduced gradient of P replicas with
local gradients g_i (mean g) is off by at most eps * mean_i ||g_i|| after the reduce-scatter
(each rank's encoding; the received chunks are summed in fp32, not requantised) and, for DDP,
eps * ||mean + that error|| more after the all-gather's encoding of the averaged shard: DDP
eps * ((1 + eps) * mean_i ||g_i|| + ||g||), FSDP2 eps * mean_i ||g_i||. SGD carries it into the
weights times the learning rate, plus the fp32 rounding the same run has uncompressed (measured
in the same launch: the uncompressed run against the one-process reference) and that of the
fp32 sum and division of the decoded chunks (a few units of 2**-24 of the summed magnitudes).
"""

from __future__ import annotations

import functools
import math
import os

import pytest

from harness import UNIT, case, fp32_bound, per_case, run_ranks
from test_codec import worst_case_error

LR = 0.5
STEPS = 3


def _grads(model, ids):
    import torch

    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _first_step(dims: dict, config) -> dict:
    """One SGD step of the replicas (replica i: rows 2i, 2i+1 of the global batch) with the
    reduction off, at its default, and on; the one-process step on the global batch; the norms
    of the replicas' local gradients (from the one-process model: TP is uncompressed)."""
    import torch

    import taco_accel
    from accelerate_loop_worker import DATA, fresh_model
    from taco_accel import ParallelDims

    data = DATA[:4]
    ref = fresh_model()
    local = [_grads(ref, data[2 * i:2 * i + 2]) for i in range(2)]
    mean = {n: (local[0][n] + local[1][n]) / 2 for n in local[0]}
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for n, p in ref.named_parameters():
        p.grad = mean[n]
    opt.step()
    expected = {n: v.detach().clone() for n, v in ref.state_dict().items()}

    def parallel(**setting) -> tuple[dict, dict]:
        acc = taco_accel.Accelerator(parallel_dims=ParallelDims(**dims), compression=None, **setting)
        model = acc.prepare(fresh_model())
        optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=LR))
        i = acc.data_parallel_rank
        ids = data[2 * i:2 * i + 2]
        acc.compression_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        state = {n: v.detach().clone() for n, v in acc.get_state_dict(model).items()}
        return state, acc.compression_stats()

    default, _ = parallel()
    off, off_stats = parallel(grad_compression="off")
    on, on_stats = parallel(grad_compression=config)
    diff = lambda a: _norm([a[n] - expected[n] for n in expected])  # noqa: E731
    return {"default_equals_off": all(torch.equal(default[n], off[n]) for n in off),
            "off": diff(off), "on": diff(on), "on_vs_off": _norm([on[n] - off[n] for n in off]),
            "norms": [_norm(g.values()) for g in local], "mean_norm": _norm(mean.values()),
            "off_stats": off_stats, "on_stats": on_stats}


def _bound(r: dict, config, ddp: bool) -> float:
    import torch

    eps = worst_case_error(config, torch.float32)
    local = sum(r["norms"]) / 2
    codec = eps * ((1 + eps) * local + r["mean_norm"]) if ddp else eps * local
    return LR * (codec + 8 * UNIT * sum(r["norms"])) + r["off"]


# --- the 2-rank launch: DDP replicas --------------------------------------------------------------


def _feedback_invariant(config) -> dict:
    """Five reductions of random gradients through the DDP bucket path and FSDP2's reduce-scatter:
    what was delivered plus the residuals against the true mean, summed over the steps."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from taco_accel.comm import Ledger
    from taco_accel.parallel import ParallelDims, build_mesh
    from taco_accel.parallel.data_parallel import DataParallelGradSync, FsdpReduceScatter, grad_sites
    from taco_accel.tp import Compression

    rank, steps = dist.get_rank(), 5
    mesh = build_mesh(ParallelDims(dp=2), "cpu")
    sites = grad_sites(mesh, Compression("on", backward=config), Ledger())
    module = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 7))  # 1447 values: no multiple of P * G
    sync = DataParallelGradSync([module], mesh, sites=sites)
    gen = torch.Generator().manual_seed(100 + rank)
    true = torch.zeros(1447, dtype=torch.float64)
    delivered = torch.zeros(1447, dtype=torch.float64)
    magnitude = torch.zeros(1447, dtype=torch.float64)
    after_first = None
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen) * (1 + step) for p in module.parameters()]
        for p, g in zip(module.parameters(), grads):
            p.grad = g.clone()
        flat = torch.cat([g.reshape(-1) for g in grads]).double()
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        true += (both[0] + both[1]) / 2
        magnitude += both[0].abs() + both[1].abs()
        sync()
        delivered += torch.cat([p.grad.reshape(-1) for p in module.parameters()]).double()
        if step == 0:
            after_first = float((delivered - true).norm() / true.norm())
    state = sync.feedback["dp.grad.bucket0"]
    workers = state.worker.double().clone()
    dist.all_reduce(workers)
    servers = [torch.empty_like(state.server) for _ in range(2)]
    dist.all_gather(servers, state.server)
    carried = workers[:1447] / 2 + torch.cat(servers).double()[:1447]
    # per value: c = g + r, c - sent, the fp32 sum of the chunks, + server, the server's residual and this
    # test's float64 sums: fewer than 8 fp32 roundings per step, each of at most the values' magnitude
    bound = fp32_bound(8 * steps, 1.0) * magnitude
    ddp = {"gap": float(((delivered + carried - true).abs() / bound).max()),
           "lost": float(((delivered - true).abs() / bound).max()), "after_first": after_first}

    nonfinite = []  # a NaN gradient on rank 0: delivered as such, never carried into the next step
    for bad in (True, False):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        if bad and rank == 0:
            next(module.parameters()).grad[0, 0] = float("nan")
        sync()
        nonfinite.append((any(bool(p.grad.isnan().any()) for p in module.parameters()),
                          bool(torch.isfinite(state.worker).all() and torch.isfinite(state.server).all())))

    comm = FsdpReduceScatter(sites.site("dp.grad.fsdp/reduce_scatter"))
    group = mesh["dp"].get_group()
    true, delivered, magnitude = (torch.zeros(2 * 333, dtype=torch.float64) for _ in range(3))
    for step in range(steps):
        x = torch.randn(2 * 333, generator=gen) * (1 + step)
        both = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(both, x)
        true += (both[0] + both[1]).double() / 2
        magnitude += (both[0].abs() + both[1].abs()).double()
        out = torch.empty(333)
        comm(output_tensor=out, input_tensor=x.clone(), group=group, op=dist.ReduceOp.AVG)
        delivered[rank * 333:(rank + 1) * 333] += out.double()
    dist.all_reduce(delivered)
    residuals = comm.residual.double().clone()
    dist.all_reduce(residuals)
    bound = fp32_bound(6 * steps, 1.0) * magnitude  # as above, without the server's two
    fsdp = {"gap": float(((delivered + residuals / 2 - true).abs() / bound).max()),
            "lost": float(((delivered - true).abs() / bound).max())}
    return {"ddp": ddp, "fsdp": fsdp, "nonfinite": nonfinite}


def _mismatch() -> dict:
    """Ranks that disagree about grad_compression, or about its codec settings."""
    import torch.distributed as dist

    import taco_accel
    from accelerate_loop_worker import fresh_model
    from taco_accel import CollectiveMismatch, ParallelDims, TacoConfig

    out = {}
    rank = dist.get_rank()
    for name, settings in {"on_off": ("on", "off"),
                           "group_size": (TacoConfig(group_size=64), TacoConfig(group_size=128))}.items():
        acc = taco_accel.Accelerator(parallel_dims=ParallelDims(dp=2), compression=None,
                                     grad_compression=settings[rank])
        try:
            acc.prepare(fresh_model())
            out[name] = None
        except CollectiveMismatch as e:
            out[name] = str(e)
    return out


def _resume(out: str, cache: str, config, mode: str) -> dict:
    """4 Trainer steps straight against 2, a checkpoint, and 2 resumed (AdamW, dp=2)."""
    from test_pipeline import train_losses

    out = os.path.join(out, mode)
    kw = dict(dp=2, dp_mode=mode, grad_compression=config)
    straight = train_losses(os.path.join(out, "straight"), cache, steps=4, **kw)
    first = train_losses(os.path.join(out, "resumed"), cache, steps=4, until=2, save_every=2, **kw)
    resumed = train_losses(os.path.join(out, "resumed"), cache, steps=4, resume="latest", **kw)
    from taco_accel.integrations.checkpoint import latest, open_checkpoint

    _, _, known = open_checkpoint(latest(os.path.join(out, "resumed", "checkpoints")))
    return {"straight": straight, "first": first, "resumed": resumed,
            "saved": sorted(k for k in known if k.startswith("grad_feedback."))}


def _two_ranks(out: str, cache: str) -> dict:
    from taco_accel import TacoConfig

    config = TacoConfig()
    return per_case({
        "first_step": functools.partial(_first_step, dict(dp=2), config),
        "feedback": functools.partial(_feedback_invariant, TacoConfig(group_size=32)),
        "mismatch": _mismatch,
        "resume_ddp": functools.partial(_resume, out, cache, config, "ddp"),
        "resume_fsdp": functools.partial(_resume, out, cache, config, "fsdp"),
    })


@pytest.fixture(scope="module")
def two(tmp_path_factory, token_cache):
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("dp_grad")), token_cache)


def test_off_is_the_default_and_sends_no_dp_traffic(two):
    for r in case(two, "first_step"):
        assert r["default_equals_off"]  # "off" is today's path, bit for bit
        assert r["off_stats"]["comm/bytes_sent"] == 0  # nothing compressed, no dp site
        assert r["off"] < 1e-5 * r["mean_norm"]  # fp32 rounding of the same step, as test_user_contracts


def test_ddp_first_step_within_the_codec_bound(two):
    from taco_accel import TacoConfig

    for r in case(two, "first_step"):
        assert r["on"] <= _bound(r, TacoConfig(), ddp=True), r
        assert r["on_vs_off"] > 100 * r["off"]  # the codec really ran
        stats = r["on_stats"]
        assert stats["comm/bytes_saved"] > 2 * stats["comm/bytes_sent"]  # fp32 gradients: about 1/4 sent


def test_error_feedback_carries_what_was_not_sent(two):
    for r in case(two, "feedback"):
        for kind in ("ddp", "fsdp"):
            f = r[kind]
            # per value, in units of its fp32 bound: delivered + residuals = the true sum over the steps;
            # without the residuals the codec's error shows (it is not lost, only delayed)
            assert f["gap"] <= 1.0, (kind, f)
            assert f["lost"] > 100, (kind, f)
        assert 1e-3 < r["ddp"]["after_first"] < 0.1  # one step's error: about the codec's, not zero
        assert r["nonfinite"] == [(True, True), (False, True)]  # NaN delivered, residuals stay finite


def test_ranks_that_disagree_raise_on_every_rank(two):
    for rank, r in enumerate(case(two, "mismatch")):  # at prepare, before any step; naming what differs
        assert r["on_off"] is not None and "mode by rank {0: 'on', 1: 'off'}" in r["on_off"], (rank, r)
        assert r["group_size"] is not None and "group_size by rank {0: 64, 1: 128}" in r["group_size"], (rank, r)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_resume_repeats_the_compressed_run(two, mode):
    units = (["bucket0.server", "bucket0.worker"] if mode == "ddp" else
             [f"model.layers.{i}.worker" for i in range(4)] + ["stage0.worker"])
    for r in case(two, f"resume_{mode}"):
        assert r["first"] == r["straight"][:2]
        assert r["resumed"] == r["straight"]  # bit for bit: the residuals came back with the checkpoint
        assert r["saved"] == sorted(f"grad_feedback.0.pp0.dp{d}.tp0.dp.grad.{unit}" for d in (0, 1) for unit in units)


# --- the 4-rank launch: FSDP2 dp=2 x tp=2 -----------------------------------------------------------


def _fsdp_tp() -> dict:
    from taco_accel import TacoConfig

    return per_case({"first_step": functools.partial(_first_step, dict(dp=2, tp=2, dp_mode="fsdp"),
                                                     TacoConfig())})


@pytest.fixture(scope="module")
def four():
    return run_ranks(_fsdp_tp, 4)


def test_fsdp_tp_first_step_within_the_codec_bound(four):
    from taco_accel import TacoConfig

    for r in case(four, "first_step"):
        assert r["default_equals_off"]
        assert r["off"] < 1e-5 * r["mean_norm"]
        assert r["on"] <= _bound(r, TacoConfig(), ddp=False), r
        assert r["on_vs_off"] > 100 * r["off"]


# --- the cost model ---------------------------------------------------------------------------------


def test_projection_counts_each_kind_of_traffic():
    from taco_accel.bench.projection import CLUSTERS, PRESETS, h200_codec, project_traffic

    preset, codec = PRESETS["qwen-7b"], h200_codec()
    r = project_traffic(preset, 8, 2, 4, 8, 8192, 4096, 400.0, CLUSTERS["eth-100g"], codec)
    k = r["kinds"]
    n = 8192 * preset.hidden
    assert k["pp"]["plain_b"] == 2 * 8 * n * 2  # per boundary and micro-batch: an activation and its gradient, bf16
    local = int(preset.params_b * 1e9 / 16)
    assert k["dp"]["plain_b"] == pytest.approx(2 * 3 / 4 * local * 4)  # ring all-reduce of fp32 gradients
    for kind in k.values():
        assert kind["taco_b"] < kind["plain_b"] and kind["auto_s"] <= kind["plain_s"]
    assert k["dp"]["auto_s"] < k["dp"]["plain_s"] / 2  # a slow link: the dp reduce pays, codec included
    assert r["speedup"] == pytest.approx(r["step_plain_s"] / r["step_auto_s"]) and r["speedup"] > 1
    alone = project_traffic(preset, 8, 1, 1, 8, 8192, 4096, 400.0, CLUSTERS["eth-100g"], codec)
    assert alone["kinds"]["pp"]["plain_b"] == alone["kinds"]["dp"]["plain_b"] == 0  # no pp, no dp: no such traffic
