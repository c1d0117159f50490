"""The recipes' command line, and the tiny recipe end to end through ``accelerate launch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv):
    from taco_accel.integrations.cli import build_parser

    return build_parser("qwen2", "test").parse_args(list(argv))


def test_compression_flags():
    from taco_accel import TacoConfig
    from taco_accel.integrations.cli import compression_from_args

    assert compression_from_args(_args("--compression", "off"), 128) is None
    assert compression_from_args(_args("--preset", "small"), 512) == TacoConfig()
    tiny = compression_from_args(_args("--preset", "nano"), 32)
    assert (tiny.group_size, tiny.threshold_bytes) == (32, 0)  # G fits h; tiny messages compressed
    assert compression_from_args(_args("--preset", "small", "--group-size", "64"), 512).group_size == 64


def test_compression_settings_file(tmp_path):
    from taco_accel import TacoConfig
    from taco_accel.integrations.cli import compression_from_args

    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"format": "e5m2", "group_size": 64}))
    assert compression_from_args(_args("--preset", "small", "--compression", str(flat)), 512) == TacoConfig(
        format="e5m2", group_size=64)
    per_site = tmp_path / "sites.json"
    per_site.write_text(json.dumps({"forward": {}, "backward": None, "sites": {"lm_head/*": None}}))
    value = compression_from_args(_args("--preset", "small", "--compression", str(per_site)), 512)
    assert value == {"forward": TacoConfig(), "backward": None, "sites": {"lm_head/*": None}}
    with pytest.raises(ValueError, match="on, off or a JSON"):
        compression_from_args(_args("--compression", "maybe"), 128)


def test_config_from_args_defaults_to_the_launch_environment():
    from taco_accel.integrations.cli import config_from_args

    cfg = config_from_args("gpt2", _args("--preset", "tiny", "--trackers", "none", "--schedule", "interleaved_1f1b"))
    assert (cfg.family, cfg.pp, cfg.dp, cfg.tp, cfg.trackers, cfg.stages_per_rank) == ("gpt2", None, None, None, (), 2)


@pytest.mark.slow
def test_tiny_recipe_through_accelerate_launch(tmp_path):
    """`accelerate launch` with the CPU tp=2 config: 3 steps of the nano preset, evaluation,
    tensorboard, the loss curve and an export that transformers loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/configs/cpu_tp2.yaml"),
        str(ROOT / "recipes/qwen_pretrain.py"), "--preset", "nano", "--steps", "3", "--eval-every", "3",
        "--eval-batches", "1", "--seq-len", "32", "--output-dir", str(tmp_path / "run"), "--no-progress", "--device", "cpu",
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "tp=2" in done.stderr
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "val_loss" in rows[-1]
    assert all(5.0 < r["loss"] < 7.0 for r in rows)  # ~ln(384) at the start
    assert rows[-1]["comm_bytes_saved"] > 0  # the TP collectives were compressed
    assert (run / "loss.png").stat().st_size > 1000
    assert any(p.name.startswith("events.out.tfevents") for p in run.rglob("*"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.num_hidden_layers == 4 and len(tokenizer) == 257
