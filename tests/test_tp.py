"""Layer 3 on its own: shard specs, sites, and the parallel layers against dense PyTorch.

The multi-rank part runs on 3 ranks (an odd tp, and a vocabulary that does not divide by it)
in one launch; each check returns its largest difference and the tests assert on them.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import case, fp32_bound, per_case, run_ranks
from torch import nn

import taco_accel
from taco_accel import TacoConfig, comm
from taco_accel.comm.pieces import PIECE_BYTES
from taco_accel.tp import (
    ColumnParallelLinear,
    Compression,
    RegionEntry,
    RegionExit,
    RowParallelLinear,
    SequenceState,
    ShardSpec,
    Site,
    SiteTable,
    VocabParallelEmbedding,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_sp_region,
    vocab_parallel_cross_entropy,
)

WORLD = 3
# parallel against dense: the same products, each sum taken in pieces over the ranks instead of in
# one go: sums of n <= 128 terms (randn inputs times nn.Linear's U(+-1/sqrt(in)) weights, their
# gradients) whose magnitudes add up to under 1
FP32 = fp32_bound(128, 1.0)

# -- single process ------------------------------------------------------------------------


def test_shard_spec_even_balanced_heads():
    assert ShardSpec.even(12, 3).ranges == (((0, 4),), ((4, 8),), ((8, 12),))
    assert ShardSpec.balanced(10, 4).ranges == (((0, 3),), ((3, 6),), ((6, 8),), ((8, 10),))
    kv = ShardSpec.heads(1, 8, 4)  # one kv head on four ranks: replicated
    assert kv.replicas == 4 and kv.ranges[3] == ((0, 8),)
    assert ShardSpec.heads(4, 8, 2).ranges == (((0, 16),), ((16, 32),))
    with pytest.raises(ValueError, match=r"tp=3 and num_heads=2"):
        ShardSpec.heads(2, 8, 3)
    with pytest.raises(ValueError, match=r"tp=3 does not divide the size=10; use a tp degree in \[1, 2, 5, 10\]"):
        ShardSpec.even(10, 3)


def test_shard_spec_fused_take_assemble():
    block = ShardSpec.even(4, 2).scaled(2)  # 4 heads of 2 -> 8 features
    fused = ShardSpec.concat([block] * 3).on_dim(1)  # GPT-2 q|k|v along dim 1
    assert fused.ranges[1] == ((4, 8), (12, 16), (20, 24))
    full = torch.arange(2 * 24.0).view(2, 24)
    parts = [fused.take(full, r) for r in range(2)]
    assert parts[1].shape == (2, 12)
    assert torch.equal(fused.assemble(parts), full)
    assert torch.equal(torch.cat([full[i] for i in fused.index(1)], dim=1), parts[1])


def test_compression_rules_per_site():
    cfg = TacoConfig(group_size=64)
    c = Compression("on", forward=cfg, backward=None, sites={"lm_head/*": None, "lm_head/bwd": cfg})
    assert c.config_for("layers.0.mlp/fwd") == cfg and c.config_for("layers.0.mlp/bwd") is None
    assert c.config_for("lm_head/bwd") == cfg  # the last matching pattern wins
    auto = Compression.resolve("auto")
    assert auto == Compression() and auto.rule_for("layers.0.mlp/bwd") == (TacoConfig(), True)
    assert auto.piece_bytes == PIECE_BYTES and auto.threshold_bytes == 0
    assert PIECE_BYTES == 32 * 2**20  # bench.projection's choice (comm.pieces)
    on = TacoConfig(group_size=32)
    mixed = Compression("auto", forward=TacoConfig(), backward=None, sites={"lm_head/*": on})
    assert mixed.rule_for("layers.0.mlp.down_proj/fwd") == (TacoConfig(), True)
    assert mixed.rule_for("layers.0.mlp/bwd") == (None, False)  # explicit off wins
    assert mixed.rule_for("lm_head/bwd") == (on, False)  # explicit on wins, untimed
    off = Compression("off", sites={"lm_head/*": on})
    assert off.rule_for("lm_head/fwd") == (None, False) and off.rule_for("x/bwd") == (None, False)  # off: all plain


def test_auto_sites_decide_once_and_record():
    """Without a group to time (emulation), an auto site decides by the auto mode's size rule
    (`UNTIMED_BYTES`, per message); under its Compression's floor it stays plain, undecided."""
    from taco_accel.comm.policy import UNTIMED_BYTES

    floor = 2 * UNTIMED_BYTES
    table = SiteTable(None, Compression("auto", sites={"b/*": None}), timed=False)
    floored = SiteTable(None, Compression("auto", threshold_bytes=floor), timed=False)
    small, big = table.site("a/fwd"), table.site("c/fwd")
    off, bwd = table.site("b/fwd"), floored.site("a/bwd")
    assert "2 decided by timing in the first steps (auto), 1 plain" in table.summary()
    assert small.decision is None and table.decisions()["a/fwd"]["compressed"] is None
    at, under = torch.ones(UNTIMED_BYTES // 4), torch.ones(UNTIMED_BYTES // 4 - 1)  # fp32 messages
    assert not small.compresses("all_reduce", torch.ones(100))  # 400 B: plain
    assert big.compresses("all_reduce", at)  # 8 MiB: compressed
    assert small.decision.rule == "size" and not small.decision.compress and big.decision.compress
    assert small.compresses("all_reduce", at) and small.decision.compress  # the rule, per message
    assert not bwd.compresses("all_reduce", at) and bwd.decision is None  # under the floor: plain, untimed
    assert not off.compresses("all_reduce", at) and off.mode == "off" and off.config is None
    record = {**table.decisions(), **floored.decisions()}
    assert record["a/fwd"]["compressed"] and record["b/fwd"] == {"mode": "off", "config": None, "compressed": False}
    assert record["a/bwd"]["compressed"] is None and bwd.mode == "auto"  # never decided
    assert "auto: compressed (size rule" in str(table) and "auto: undecided" in str(floored)
    table.set_group_sizes({"c/fwd": 32})  # calibration keeps the decision
    assert big.compresses("all_reduce", at) and big.config.group_size == 32
    assert not big.compresses("all_reduce", under) and not big.decision.compress  # the rule, per message
    assert bwd.compresses("all_reduce", torch.ones(floor // 4)) and bwd.decision.compress  # from the floor on


def test_site_table_print_and_sizes(tmp_path):
    table = SiteTable(None, Compression.resolve(TacoConfig()))
    table.site("layers.0.mlp.down_proj/fwd")
    assert table.group_sizes() == {"layers.0.mlp.down_proj/fwd": 128}
    assert "layers.0.mlp.down_proj/fwd  e4m3 G=128" in str(table)
    table.start_recording(max_elements=64)
    table["layers.0.mlp.down_proj/fwd"].observe(torch.randn(10, 32))
    assert table["layers.0.mlp.down_proj/fwd"].samples[0].shape == (2, 32)  # evenly spaced rows
    assert table.calibrate(candidates=(32,)) == {"layers.0.mlp.down_proj/fwd": 32}
    assert table["layers.0.mlp.down_proj/fwd"].samples is None


def test_two_models_keep_separate_counts():
    """Each parallelised model's sites record into its own ledger; `pop_comm_stats` adds them up."""
    from taco_accel.models.tiny import tiny_model

    on = TacoConfig()
    first, second = (taco_accel.parallelize(tiny_model("qwen2"), tp=2, compression=on, emulate=True) for _ in range(2))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    comm.pop_comm_stats()
    with torch.no_grad():
        for model in (first, first, second):
            model(ids)
    a, b = first.taco.sites.pop_stats(), second.taco.sites.pop_stats()
    assert a and a.keys() == b.keys() and set(a) <= set(first.taco.sites)
    for name in a:
        assert (a[name].calls, a[name].bytes_sent) == (2 * b[name].calls, 2 * b[name].bytes_sent), name
        assert a[name].compressed_calls == a[name].calls > 0
    with torch.no_grad():
        first(ids), second(ids)
    every = comm.pop_comm_stats()  # both models, added up where the names meet
    assert all(every[name].calls == 2 * b[name].calls for name in a)
    assert first.taco.sites.pop_stats() == {} and second.taco.sites.pop_stats() == {}


def test_one_rank_layers_are_plain_layers():
    torch.manual_seed(0)
    dense = nn.Linear(8, 6)
    col = ColumnParallelLinear.from_module(dense)
    x = torch.randn(2, 3, 8)
    assert torch.equal(col(x), dense(x))
    assert "tp=1" in repr(col) and col.in_features == 8 and col.out_features == 6


# -- three ranks ---------------------------------------------------------------------------


def _site(name: str, config=None) -> Site:
    return Site(name, None, config)


def _copy_param(dense: torch.Tensor, spec: ShardSpec | None, rank: int) -> torch.Tensor:
    return dense.detach() if spec is None else spec.take(dense.detach(), rank)


def _diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _mlp(sequence: SequenceState | None, conv1d: bool) -> dict:
    """dense fc1 -> gelu -> fc2 vs. column -> gelu -> row, optionally on sequence shards."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(12, 18), nn.Linear(18, 12)
    x = torch.randn(2, 6, 12, requires_grad=True)
    entry = RegionEntry(_site("fc1/fwd"), _site("fc1/bwd"), sequence)
    col = ColumnParallelLinear(12, 18, group=None, entry=entry, conv1d=conv1d)
    exit_ = RegionExit(_site("fc2/fwd"), _site("fc2/bwd"), sequence)
    row = RowParallelLinear(18, 12, group=None, reduce=exit_, conv1d=conv1d)
    for layer, dense in ((col, fc1), (row, fc2)):
        weight = dense.weight.t() if conv1d else dense.weight
        layer.weight.data.copy_(_copy_param(weight, layer.shards["weight"], rank))
        layer.bias.data.copy_(_copy_param(dense.bias, layer.shards.get("bias"), rank))
    expected = fc2(F.gelu(fc1(x)))
    expected.square().sum().backward()
    xp = x.detach().clone().requires_grad_()
    h = xp
    if sequence is not None:
        sequence.begin(6)
        h = scatter_to_sp_region(xp, _site("split/bwd"))  # (2, 2, 12)
    out = row(F.gelu(col(h)))
    if sequence is not None:
        out = gather_from_sp_region(out, _site("gather/fwd"))  # blocks -> (2, 6, 12), backward: own block
    out.square().sum().backward()
    w1 = fc1.weight.grad.t() if conv1d else fc1.weight.grad
    w2 = fc2.weight.grad.t() if conv1d else fc2.weight.grad
    grad_b2 = row.bias.grad.clone()
    if sequence is not None:  # the row bias saw this rank's tokens only
        dist.all_reduce(grad_b2)
    return {
        "out": _diff(out, expected),
        "x_grad": _diff(xp.grad, x.grad),
        "w1": _diff(col.weight.grad, col.shards["weight"].take(w1, rank)),
        "b1": _diff(col.bias.grad, col.shards["bias"].take(fc1.bias.grad, rank)),
        "w2": _diff(row.weight.grad, row.shards["weight"].take(w2, rank)),
        "b2": _diff(grad_b2, fc2.bias.grad),
    }


def _embedding_and_loss() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    vocab, hidden = 10, 4  # 10 rows over 3 ranks: 4, 3, 3
    dense = nn.Embedding(vocab, hidden, padding_idx=5)
    emb = VocabParallelEmbedding(vocab, hidden, padding_idx=5, reduce=RegionExit(_site("emb/fwd")))
    emb.weight.data.copy_(emb.shard.take(dense.weight.detach(), rank))
    ids = torch.tensor([[0, 5, 9, 3], [4, 7, 5, 1]])
    out, expected = emb(ids), dense(ids)
    out.sum().backward()
    expected.sum().backward()
    head = ShardSpec.balanced(vocab, WORLD).on_dim(-1)
    logits = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(1)).requires_grad_()
    target = torch.tensor([[1, 9, -100, 4], [0, 3, 8, -100]])
    local = head.take(logits.detach(), rank).requires_grad_()
    start = head.ranges[rank][0][0]
    site = _site("loss/lse")
    loss = vocab_parallel_cross_entropy(local, target, [start], lambda parts: gather_from_tp_region(parts, site, dim=0),
                                        chunk=3)  # chunks of 3 of the 8 tokens
    ref = F.cross_entropy(logits.view(-1, vocab), target.view(-1), reduction="none").view(2, 4)
    loss.sum().backward()
    ref.sum().backward()
    return {
        "emb": _diff(out, expected),
        "emb_grad": _diff(emb.weight.grad, emb.shard.take(dense.weight.grad, rank)),
        "ce": _diff(loss, ref),
        "ce_grad": _diff(local.grad, head.take(logits.grad, rank)),
        "local_vocab": local.shape[-1],
    }


def _replicated_kv() -> dict:
    """One kv head held by all three ranks: its weight gradient is summed over them."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Linear(6, 4)
    spec = ShardSpec.heads(1, 4, WORLD)
    layer = ColumnParallelLinear(6, 4, shard=spec, replica_site=_site("k/replica_grad"))
    layer.weight.data.copy_(dense.weight.detach())
    layer.bias.data.copy_(dense.bias.detach())
    x = torch.randn(3, 5, 6)
    # each rank uses the head for its own "query heads": different upstream gradients
    scale = torch.tensor([1.0, 2.0, 3.0])
    (layer(x) * scale[rank]).sum().backward()
    (dense(x) * scale.sum()).sum().backward()
    return {"w": _diff(layer.weight.grad, dense.weight.grad), "b": _diff(layer.bias.grad, dense.bias.grad)}


def _compressed_site() -> dict:
    """A compressed backward site records its statistics under its own name."""
    torch.manual_seed(dist.get_rank())
    cfg = TacoConfig(group_size=32)
    x = torch.randn(4, 64, requires_grad=True)
    entry = RegionEntry(None, _site("blk/bwd", cfg))
    comm.pop_comm_stats()
    entry(x).mul(torch.randn(4, 64)).sum().backward()
    stats = comm.pop_comm_stats()
    return {"compressed_calls": stats["blk/bwd"].compressed_calls, "finite": bool(torch.isfinite(x.grad).all())}


def _auto_sites() -> dict:
    """Auto sites timed on the real group: one decision for all ranks, stats that follow it."""
    from taco_accel.comm.autotune import AutoDecider

    torch.manual_seed(dist.get_rank())
    decider = AutoDecider(None)
    first, second = (Site(f"blk{i}/bwd", None, TacoConfig(group_size=32), decider) for i in range(2))
    floor = Site("blk2/bwd", None, TacoConfig(group_size=32), decider, threshold_bytes=4 * 64 * 4 + 1)
    comm.pop_comm_stats()
    for site in (first, second, floor):
        x = torch.randn(4, 64, requires_grad=True)
        RegionEntry(None, site)(x).mul(torch.randn(4, 64)).sum().backward()
    stats = comm.pop_comm_stats()
    return {
        "decisions": [s.decision.to_dict() for s in (first, second)],
        "compressed_calls": [stats[s.name].compressed_calls for s in (first, second, floor)],
        "floor": {"decision": floor.decision, "calls": stats[floor.name].calls},
    }


def _in_place_and_blocks() -> dict:
    """g reduces the partial product in place; SP blocks are views, gathered back whole."""
    rank = dist.get_rank()
    inputs = [torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    x = inputs[rank].clone().requires_grad_()
    partial = x * 2  # a computed tensor of its own, as a row layer's partial product is
    y = reduce_from_tp_region(partial, _site("g/fwd"), inplace=True)
    in_place = y.data_ptr() == partial.data_ptr()
    y.sum().backward()
    with torch.no_grad():  # a layer's partial product is reduced in place, in inference too
        row = RowParallelLinear(12, 4, group=None, reduce=RegionExit(_site("row/fwd")), bias=False)
        made = []

        def partial(t, product=row.partial):
            made.append(product(t))
            return made[-1]

        row.partial = partial
        row_in_place = row(torch.randn(2, 6, 4)).data_ptr() == made[0].data_ptr()
    full = torch.arange(2 * 6 * 12, dtype=torch.float32).view(2, 6, 12)  # (b, s, h), the same on every rank
    block = scatter_to_sp_region(full, _site("split/bwd"))  # (2, 2, 12): this rank's third of the token rows
    return {
        "in_place": in_place and row_in_place, "sum": _diff(y, sum(t * 2 for t in inputs)), "grad": _diff(x.grad, torch.full_like(x, 2)),
        "block_is_view": block.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(),
        "block": torch.equal(block, full.view(WORLD, -1)[rank].view(2, 2, 12)),
        "whole": torch.equal(gather_from_sp_region(block, _site("gather/fwd")), full),
    }


def _worker() -> dict:
    return per_case({
        "in_place": _in_place_and_blocks,
        "auto": _auto_sites,
        "mlp": functools.partial(_mlp, None, conv1d=False),
        "mlp_conv1d": functools.partial(_mlp, None, conv1d=True),
        "mlp_sp": functools.partial(_mlp, SequenceState(True, WORLD), conv1d=False),
        "embedding_loss": _embedding_and_loss,
        "replicated_kv": _replicated_kv,
        "compressed": _compressed_site,
    })


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, WORLD)


@pytest.mark.parametrize("name", ["mlp", "mlp_conv1d", "mlp_sp"])
def test_column_row_pair_matches_dense(measured, name):
    for r in case(measured, name):
        assert max(r.values()) < FP32, r


def test_g_reduces_in_place_and_sp_blocks_are_views(measured):
    for r in case(measured, "in_place"):
        assert r["in_place"] and r["block_is_view"] and r["block"] and r["whole"], r
        assert r["sum"] < 1e-5 and r["grad"] == 0, r  # 3 fp32 sums of |x| < 20: a few ulps at most


def test_vocab_parallel_embedding_and_cross_entropy(measured):
    for rank, r in enumerate(case(measured, "embedding_loss")):
        assert max(v for k, v in r.items() if k != "local_vocab") < FP32, r
        assert r["local_vocab"] == (4 if rank == 0 else 3)  # uneven slices, never the full vocabulary


def test_replicated_kv_heads_sum_their_gradients(measured):
    for r in case(measured, "replicated_kv"):
        assert max(r.values()) < FP32, r


def test_auto_sites_agree_share_timings_and_report_what_ran(measured):
    ranks = case(measured, "auto")
    auto = ranks[0]
    assert all(r == auto for r in ranks)  # the same figures on every rank
    first, second = auto["decisions"]
    assert first["rule"] == "timed" and first["timed_at"] is None and first["nbytes"] == 4 * 64 * 4
    assert second["timed_at"] == "blk0/bwd" and second["compress"] == first["compress"]  # one timing
    assert auto["compressed_calls"] == [int(first["compress"])] * 2 + [0]  # stats say what was sent
    assert auto["floor"] == {"decision": None, "calls": 1}  # under its config's floor: plain, never timed


def test_compressed_site_goes_through_the_codec(measured):
    for r in case(measured, "compressed"):
        assert r == {"compressed_calls": 1, "finite": True}
