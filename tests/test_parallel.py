"""Mesh sizes from arguments and from `accelerate launch`, layer splits, stage pruning, and
`StageModule` against the transformers forward (single process)."""

from __future__ import annotations

import pytest
import torch

from taco_accel.parallel import ParallelDims, StageModule, build_schedule, prune_to_stage, split_layers
from taco_accel.parallel.pipeline import is_tied, stage_costs


def _clear(monkeypatch):
    for key in ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE",
                "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "TACO_PP_SIZE", "TACO_DP_MODE"):
        monkeypatch.delenv(key, raising=False)


def _accelerate(monkeypatch, tp=1, replicate=1, shard=1):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(tp))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", str(replicate))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(shard))


def test_dims_from_arguments(monkeypatch):
    _clear(monkeypatch)
    assert ParallelDims.from_env(8, tp=2) == ParallelDims(pp=1, dp=4, tp=2)
    assert ParallelDims.from_env(8, tp=2, dp=2) == ParallelDims(pp=2, dp=2, tp=2)
    assert ParallelDims.from_env(1) == ParallelDims()
    assert ParallelDims(pp=2, dp=2, tp=2).coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    with pytest.raises(ValueError, match="needs 12 processes"):
        ParallelDims.from_env(8, pp=3, dp=2, tp=2)
    with pytest.raises(ValueError, match="dp_mode"):
        ParallelDims(dp_mode="zero3")


def test_dims_from_accelerate_launch(monkeypatch):
    _clear(monkeypatch)
    _accelerate(monkeypatch, tp=4)
    assert ParallelDims.from_env(8) == ParallelDims(pp=2, dp=1, tp=4)  # the processes left form pp
    _accelerate(monkeypatch, tp=2, replicate=2)
    assert ParallelDims.from_env(8) == ParallelDims(pp=2, dp=2, tp=2)  # TP with replicated dp is fine here
    _accelerate(monkeypatch, tp=2, shard=2)
    assert ParallelDims.from_env(4) == ParallelDims(pp=1, dp=2, tp=2, dp_mode="fsdp")
    monkeypatch.setenv("TACO_PP_SIZE", "2")
    with pytest.raises(ValueError, match="multiply"):
        ParallelDims.from_env(16)
    _accelerate(monkeypatch, tp=2, replicate=2, shard=2)
    with pytest.raises(ValueError, match="HSDP"):
        ParallelDims.from_env(8)


def test_split_layers_balances_embedding_and_head():
    assert split_layers(8, 2) == [range(0, 4), range(4, 8)]
    heavy_head = split_layers(8, 4, embed_cost=0, head_cost=2)
    assert [len(r) for r in heavy_head][-1] == 1 and max(len(r) for r in heavy_head) == 3  # max cost 3
    assert [r.start for r in heavy_head][0] == 0 and heavy_head[-1].stop == 8
    assert [len(r) for r in split_layers(28, 4, 1.0, 2.3)] == [7, 8, 8, 5]
    with pytest.raises(ValueError, match="each needs a layer"):
        split_layers(3, 4)


def test_stage_costs_grow_with_the_vocabulary():
    from taco_accel.training.presets import model_config

    small = stage_costs(model_config("qwen2", "7b", vocab_size=152064, max_positions=4096), 4096)
    assert small[0] == 1.0 and 1.0 < small[1] < 4.0


def _model(family, **kw):
    from transformers import AutoModelForCausalLM

    from taco_accel.training.presets import model_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(family, "nano", vocab_size=128, max_positions=32, **kw)).eval()


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_stages_chain_to_the_transformers_forward(family):
    model = _model(family)
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(x).logits
        parts = [prune_to_stage(model, r, i == 0, i == 2) for i, r in enumerate(split_layers(4, 3))]
        h = x
        for i, part in enumerate(parts):
            h = StageModule(part, is_first=i == 0, is_last=i == 2)(h)
        logits = parts[2].lm_head(h)  # the last stage ends in the final norm: the head belongs to the loss
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    keys = [set(p.state_dict()) for p in parts]
    full = set(model.state_dict())
    assert set().union(*keys) == full | ({"lm_head.weight"} if is_tied(model) else set())
    assert "model.layers.3.mlp.down_proj.weight" in keys[2] or "transformer.h.3.mlp.c_proj.weight" in keys[2]
    if is_tied(model):  # the head copy on the last stage is its own parameter, equal at the start
        assert parts[2].lm_head.weight is not model.lm_head.weight
        torch.testing.assert_close(parts[2].lm_head.weight, model.lm_head.weight)


def test_schedule_names_are_checked():
    with pytest.raises(ValueError, match="not supported"):
        build_schedule("zigzag", [], 2, None)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("1f1b", [object(), object()], 2, None)


def test_layering_of_parallel_data_and_integrations():
    """parallel/ and data/ never import Accelerate, the integrations or the application; only integrations/ does."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "taco_accel"
    for package, forbidden in (("parallel", ("accelerate", "integrations", "training")),
                               ("data", ("accelerate", "integrations", "training", "parallel"))):
        for file in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    assert not any(part in forbidden for part in name.split(".")), f"{file.name} imports {name}"


_EXIT_SCRIPT = """
import atexit, json, sys
import torch.distributed as dist
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(dist.is_initialized())))  # runs after taco_accel's hook
from taco_accel.parallel import ParallelDims, build_mesh
build_mesh(ParallelDims(), "cpu")  # gloo, whose teardown this test is about
if sys.argv[2] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending, code, left_initialized", [("return", 0, False), ("raise", 1, True)])
def test_process_groups_are_destroyed_at_a_clean_exit_only(tmp_path, ending, code, left_initialized):
    """A script that never destroys its groups: gloo would free them in the interpreter's teardown
    and may abort there; taco_accel destroys them at a normal exit, and not after an uncaught
    exception (peers may still be inside a collective with this rank)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "state.json"), ending], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stderr[-3000:]
    assert json.loads((tmp_path / "state.json").read_text()) is left_initialized


def _pair_groups(pp: int) -> dict:
    import torch.distributed as dist

    from taco_accel.parallel import build_mesh
    from taco_accel.parallel.mesh import pp_pair_groups

    mesh = build_mesh(ParallelDims(pp=pp, tp=4 // pp), "cpu")
    pairs = [(b, (b + 1) % pp) for b in range(pp)] + [(0, pp - 1), (1, 1)]
    out = {}
    for key, group in pp_pair_groups(mesh, pairs).items():
        ranks = torch.zeros(dist.get_world_size())
        ranks[dist.get_rank()] = 1
        dist.all_reduce(ranks, group=group)
        out[tuple(sorted(key))] = ranks.nonzero().flatten().tolist()
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_pp_pair_groups_join_the_two_pp_ranks_of_one_dp_tp_coordinate(pp):
    from harness import run_ranks

    for rank, groups in enumerate(run_ranks(_pair_groups, 4, pp)):
        me = rank // (4 // pp)  # pp is the outermost mesh axis
        expected = {tuple(sorted(p)) for p in [(b, (b + 1) % pp) for b in range(pp)] if me in p and p[0] != p[1]}
        assert set(groups) == expected  # only this rank's pairs; (1, 1) is no pair
        for p, q in groups:
            # the same (dp, tp) coordinate at pp ranks p and q: global ranks p * step + offset
            step, offset = 4 // pp, rank % (4 // pp)
            assert groups[p, q] == [p * step + offset, q * step + offset]
