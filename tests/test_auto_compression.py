"""``parallelize(model)`` with its default ``compression="auto"`` on two gloo ranks.

Every site decides in the first step by timing. The timings run on the real group, but their
verdict is injected (`harness.timed_verdicts`), so that each code path runs on every machine
whatever its speed: all sites compressed, all plain, and a mix. What must hold is that every
rank decides alike, that the statistics report what was actually sent, that explicit choices
win, and that the numbers follow the decisions: an auto run equals, bit for bit, the explicit
run with the same decisions (the same collectives on the same values).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.distributed as dist
from harness import case, per_case, run_ranks, timed_verdicts

import taco_accel
from taco_accel import comm
from taco_accel.models.tiny import tiny_model

ON = taco_accel.TacoConfig()


def _steps(model, ids, n: int = 2) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    return losses


def _auto(verdict: bool) -> dict:
    """The default mode with every timing's verdict ``verdict``, against the explicit mode."""
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
        with timed_verdicts(lambda kind, x, config: verdict):
            auto = taco_accel.parallelize(copy.deepcopy(ref))
            comm.pop_comm_stats()
            losses = _steps(auto, ids)
            stats = {site: s.to_dict() for site, s in comm.pop_comm_stats().items()}
    finally:
        records.removeHandler(handler)
    explicit = taco_accel.parallelize(copy.deepcopy(ref), compression="on" if verdict else "off")
    return {"decisions": auto.taco.sites.decisions(), "stats": stats, "losses": losses,
            "explicit_losses": _steps(explicit, ids), "log": lines}


def _explicit_choices_win() -> dict:
    """Forward sites auto (group size 128: the verdict compressed), backward sites auto (group size
    64: plain), but the lm head's on and one MLP's backward off; against the explicit mode with
    the same choices."""
    ref = tiny_model("qwen2")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    forced = {"mode": "auto", "forward": taco_accel.TacoConfig(), "backward": taco_accel.TacoConfig(group_size=64),
              "sites": {"lm_head/*": ON, "layers.0.mlp/bwd": None}}
    with timed_verdicts(lambda kind, x, config: config.group_size == 128):
        mixed = taco_accel.parallelize(copy.deepcopy(ref), compression=forced)
        losses = _steps(mixed, ids)
    explicit = taco_accel.parallelize(copy.deepcopy(ref), compression=taco_accel.Compression(
        "on", forward=ON, backward=None, sites={"lm_head/*": ON}))
    return {"decisions": {name: (r["mode"], r["compressed"]) for name, r in mixed.taco.sites.decisions().items()},
            "losses": losses, "explicit_losses": _steps(explicit, ids)}


def _worker() -> dict:
    return per_case({"on": functools.partial(_auto, True), "off": functools.partial(_auto, False),
                     "mixed": _explicit_choices_win, "rank": dist.get_rank})


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("verdict", ["on", "off"], ids=["compress", "plain"])
def test_auto_decides_alike_and_follows_its_decisions(ranks, verdict):
    assert case(ranks, "rank") == [0, 1]
    results = case(ranks, verdict)
    decisions = results[0]["decisions"]
    assert all(r["decisions"] == decisions for r in results)  # figures included
    assert decisions and all(d["mode"] == "auto" and d["compressed"] == (verdict == "on")
                             for d in decisions.values()), decisions
    for name, d in decisions.items():
        calls = results[0]["stats"][name]
        assert calls["compressed_calls"] == (calls["calls"] if d["compressed"] else 0), (name, d, calls)
    for r in results:  # the same collectives on the same values as the explicit mode: bit for bit
        assert r["losses"] == r["explicit_losses"], (r["losses"], r["explicit_losses"])
    log = "\n".join(results[0]["log"])
    assert "decided by timing in the first steps (auto)" in log
    assert "auto compression decided:" in log and f"of {len(decisions)} sites compressed" in log
    assert not any("auto compression" in line for line in results[1]["log"])  # rank 0 logs the decisions


def test_explicit_choices_win_over_auto(ranks):
    for r in case(ranks, "mixed"):
        mixed = r["decisions"]
        assert mixed["lm_head/bwd"] == ("on", True)  # explicit on wins over auto
        assert mixed["layers.0.mlp/bwd"] == ("off", False)  # explicit off wins
        assert mixed["layers.0.mlp.down_proj/fwd"] == ("auto", True)  # the verdicts, per direction's settings
        assert mixed["layers.1.mlp/bwd"] == ("auto", False)
        assert r["losses"] == r["explicit_losses"], r  # bit for bit
