"""The recipes' command line, and the tiny recipe end to end through ``accelerate launch``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from doc_commands import documented
from harness import run_command

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv):
    from taco_accel.training.cli import build_parser

    return build_parser("qwen2", "test").parse_args(list(argv))


def test_compression_flags():
    from taco_accel import Compression, TacoConfig
    from taco_accel.training.cli import compression_from_args

    assert compression_from_args(_args("--compression", "off"), 128) == Compression("off")
    assert compression_from_args(_args("--preset", "small"), 512) == Compression()  # auto: timing decides, per site
    tiny = compression_from_args(_args("--preset", "nano"), 32)
    assert tiny.mode == "on" and tiny.forward == tiny.backward == TacoConfig(group_size=32)  # G fits h
    assert compression_from_args(_args("--preset", "small", "--compression", "on"), 512) == Compression("on")
    auto = compression_from_args(_args("--preset", "small", "--group-size", "64", "--compression-threshold", "4096"), 512)
    cfg = TacoConfig(group_size=64)
    assert auto == Compression("auto", cfg, cfg, threshold_bytes=4096)


def test_compression_settings_file(tmp_path):
    from taco_accel import Compression, TacoConfig
    from taco_accel.training.cli import compression_from_args

    flat = tmp_path / "flat.json"  # TacoConfig fields alone: on, both directions
    flat.write_text(json.dumps({"format": "e5m2", "group_size": 64}))
    cfg = TacoConfig(format="e5m2", group_size=64)
    assert compression_from_args(_args("--preset", "small", "--compression", str(flat)), 512) == Compression("on", cfg, cfg)
    per_site = tmp_path / "sites.json"
    per_site.write_text(json.dumps({"mode": "on", "forward": {}, "backward": None, "sites": {"lm_head/*": None}}))
    value = compression_from_args(_args("--preset", "small", "--compression", str(per_site), "--group-size", "32"), 512)
    # --group-size applies over the file's every config; None stays plain
    assert value == Compression("on", TacoConfig(group_size=32), None, {"lm_head/*": None})
    with pytest.raises(SystemExit):  # the parser refuses it: one line, status 2 (tests/test_faults_io.py)
        _args("--compression", "maybe")


def test_config_from_args_defaults_to_the_launch_environment(monkeypatch):
    from taco_accel.training.cli import config_from_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    cfg = config_from_args("gpt2", _args("--preset", "tiny", "--trackers", "none", "--schedule", "interleaved_1f1b"))
    assert (cfg.family, cfg.pp, cfg.dp, cfg.tp, cfg.trackers, cfg.stages_per_rank) == ("gpt2", None, None, None, (), 2)


def test_a_run_without_an_output_dir_refuses_what_writes_files():
    from taco_accel.training import TrainConfig

    TrainConfig(output_dir=None, trackers=(), export=False, plot=False)  # a run that keeps its history in memory
    for asked in ({"export": True}, {"plot": True}, {"trackers": ("tensorboard",)}, {"save_every": 2},
                  {"resume": "latest"}):
        values = dict(output_dir=None, trackers=(), export=False, plot=False) | asked
        with pytest.raises(ValueError, match="output_dir=None writes nothing.*name an output_dir") as error:
            TrainConfig(**values)
        assert str(next(iter(asked.values()))) in str(error.value)  # the value that asks for files is named


def test_one_process_emulates_tp2_for_the_small_presets(monkeypatch):
    from taco_accel.training.cli import config_from_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert config_from_args("qwen2", _args("--trackers", "none")).tp == 2  # the laptop default still runs TACO
    assert config_from_args("qwen2", _args("--preset", "small")).tp is None  # a real model: no emulation
    assert config_from_args("qwen2", _args("--tp", "1")).tp == 1
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    assert config_from_args("qwen2", _args()).tp is None  # the launch config decides


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_help_shows_every_real_default(recipe):
    from taco_accel.training import cli, finetune_cli

    parser = cli.build_parser("qwen2", "x") if recipe == "pretrain" else finetune_cli.build_parser("qwen2", "x")
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
    assert "--steps STEPS" in text and "optimizer steps (default:" in text


@pytest.mark.parametrize("flag,value", [("--save-every", "-1"), ("--steps", "0"), ("--lr", "-3"), ("--tp", "0"),
                                        ("--seq-len", "abc"), ("--eval-every", "-5"), ("--lr", "nan")])
def test_bad_numeric_flags_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        _args(flag, value)
    assert flag in capsys.readouterr().err


def test_the_simple_launchers_ignored_process_count_is_detected():
    from taco_accel.integrations.launch import requested_processes

    argv = ["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "r.py"]
    assert requested_processes(argv) == 2
    assert requested_processes(["python", "-m", "accelerate.commands.launch", "--num-processes=4", "r.py"]) == 4
    assert requested_processes(["accelerate", "launch", "r.py"]) is None
    assert requested_processes(["python", "train.py", "--num_processes", "2"]) is None  # not accelerate launch


@pytest.mark.slow
def test_tiny_recipe_through_accelerate_launch(tmp_path, token_cache):
    """The README's laptop command (`accelerate launch` with the CPU tp=2 config), shortened to 3
    steps of the nano preset: evaluation, tensorboard, the loss curve and an export that
    transformers loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [  # the README's laptop command, shortened
        *documented("accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/qwen_pretrain.py"),
        "--preset", "nano", "--steps", "3", "--eval-every", "3", "--eval-batches", "1", "--seq-len", "32",
        "--output-dir", str(tmp_path / "run"), "--cache-dir", token_cache, "--no-progress", "--device", "cpu",
    ]
    done = run_command(cmd, env=env, cwd=tmp_path, timeout=300)
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


def test_compile_and_checkpointing_flags(monkeypatch):
    from taco_accel.training import TrainConfig
    from taco_accel.training.cli import config_from_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config_from_args("qwen2", _args("--trackers", "none"))
    assert (cfg.compile, cfg.compile_backend, cfg.activation_checkpointing) == (None, "inductor", False)  # None: CUDA's
    cfg = config_from_args("qwen2", _args("--no-compile", "--gradient-checkpointing", "--compile-backend", "aot_eager"))
    assert (cfg.compile, cfg.compile_backend, cfg.activation_checkpointing) == (False, "aot_eager", True)
    assert config_from_args("qwen2", _args("--compile", "--activation-checkpointing")).compile is True
    with pytest.raises(ValueError, match="compile_backend='nope'.*inductor"):
        TrainConfig(compile_backend="nope")
