"""``parallelize(model)`` with its default ``compression="auto"`` on two gloo ranks.

Every site decides in the first step by timing (the figures are not asserted: speed is for the
benchmarks); what must hold is that every rank decides alike, that the statistics report what
was actually sent, that explicit choices win, and that the numbers follow the decisions.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from harness import run_ranks

import taco_accel
from taco_accel import comm
from taco_accel.models.tiny import tiny_model

ON = taco_accel.TacoConfig(threshold_bytes=0)


def _step(model, ids) -> float:
    loss = model(ids, labels=ids).loss
    loss.backward()
    return float(loss)


def _worker() -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8))
    ref = tiny_model("qwen2")
    records = logging.getLogger("taco_accel")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    records.addHandler(handler)
    records.setLevel(logging.INFO)
    try:
        auto = taco_accel.parallelize(copy.deepcopy(ref))
        comm.pop_comm_stats()
        losses = [_step(auto, ids) for _ in range(2)]
        stats = {site: s.to_dict() for site, s in comm.pop_comm_stats().items()}
    finally:
        records.removeHandler(handler)
    off = taco_accel.parallelize(copy.deepcopy(ref), compression="off")
    forced = {"forward": taco_accel.TacoConfig(), "backward": None, "auto": True, "sites": {"lm_head/*": ON}}
    mixed = taco_accel.parallelize(copy.deepcopy(ref), compression=forced)
    _step(mixed, ids)
    return {
        "decisions": auto.taco.sites.decisions(),
        "stats": stats,
        "losses": losses,
        "off_loss": _step(off, ids),
        "log": lines,
        "mixed": {name: (r["mode"], r["compressed"]) for name, r in mixed.taco.sites.decisions().items()},
        "rank": dist.get_rank(),
    }


def test_auto_decides_alike_and_reports_what_ran():
    ranks = run_ranks(_worker, 2)
    decisions = ranks[0]["decisions"]
    assert all(r["decisions"] == decisions for r in ranks)  # figures included
    assert decisions and all(d["mode"] == "auto" and d["compressed"] in (True, False) for d in decisions.values())
    for name, d in decisions.items():
        calls = ranks[0]["stats"][name]
        assert calls["compressed_calls"] == (calls["calls"] if d["compressed"] else 0), (name, d, calls)
    if not any(d["compressed"] for d in decisions.values()):  # all plain: the plain run's numbers exactly
        assert ranks[0]["losses"][0] == ranks[0]["off_loss"]
    else:
        assert abs(ranks[0]["losses"][0] - ranks[0]["off_loss"]) < 0.01 * abs(ranks[0]["off_loss"])
    log = "\n".join(ranks[0]["log"])
    assert "decided by timing in the first steps (auto)" in log
    assert "auto compression decided:" in log and f"of {len(decisions)} sites compressed" in log
    assert not any("auto compression" in line for line in ranks[1]["log"])  # rank 0 logs the decisions
    mixed = ranks[0]["mixed"]
    assert mixed["lm_head/bwd"] == ("on", True)  # explicit on wins over auto
    assert mixed["layers.0.mlp/bwd"] == ("off", False)  # explicit off wins
    assert mixed["layers.0.mlp.down_proj/fwd"][0] == "auto"
