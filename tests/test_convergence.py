"""Smoke test of the convergence study (``python -m taco_accel.bench.convergence``) on the nano preset.

The study's runs are `Trainer` runs, whose Accelerator starts a process group and Accelerate's
process state: each test runs the command lines in a process of its own (`run_ranks`, one rank)."""

from __future__ import annotations

import contextlib
import io
import json
import sysconfig
from pathlib import Path

import pytest
import torch
from harness import run_ranks

from taco_accel.bench import convergence
from taco_accel.comm.emulated import EmulatedGroup
from taco_accel.training.loop import lr_lambda


def _small_text(tmp_path) -> str:
    """20 kB of the standard library's own source (the shipped corpus takes seconds to tokenise)."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    path = tmp_path / "text.txt"
    path.write_text(source.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return str(path)


def _commands(argvs: list[list[str]], folder: str) -> list[tuple[dict, str, dict]]:
    """``convergence.main`` of each command line in turn: its records, what it printed and the
    records ``folder`` (``--out``) holds for seed 0 then."""
    out = []
    for argv in argvs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            records = convergence.main(argv)
        saved = {path.stem: json.loads(path.read_text()) for path in (Path(folder) / "seed0").glob("*.json")}
        out.append((records, printed.getvalue(), saved))
    return out


def test_study_runs_and_reports(tmp_path):
    argv = ["--preset", "nano", "--data", _small_text(tmp_path), "--out", str(tmp_path)]
    (records, printed, saved), (again, _, _) = run_ranks(
        _commands, 1, [[*argv, "--variants", "none", "naive", "taco", "pp-boundaries", "--fidelity"],
                       [*argv, "--variants", "taco", "--report"]],
        str(tmp_path))[0]
    records, again = records[0], again[0]  # seed 0
    preset = convergence.PRESETS["nano"]
    assert set(records) == {"none", "naive", "taco", "pp-boundaries"}
    # the one loop's schedule at the preset's peak and warm-up (the lr a row reports is its step's)
    factor = lr_lambda(convergence.run_config(preset, seed=0, compression=None, device=torch.device("cpu")))
    assert [round(factor(s), 6) for s in (0, preset.warmup, preset.steps)] == [1 / preset.warmup, 1.0, 0.1]
    for key, record in records.items():
        assert record["steps"] == preset.steps
        assert [h["step"] for h in record["history"] if "val_loss" in h] == [2, 4]
        assert [h["lr"] for h in record["history"]] == pytest.approx([preset.lr * factor(s) for s in range(4)])
        assert saved[key]["final_val"] == record["final_val"]
    first = {k: r["history"][0]["loss"] for k, r in records.items()}  # same weights and batch, other codec
    assert first["taco"] != first["none"] and abs(first["taco"] - first["none"]) < 1e-2 * first["none"]
    assert records["none"]["history"][0]["comm_compression"] == 1.0  # plain sums
    assert records["taco"]["history"][0]["comm_compression"] > 3  # every message compressed: G=128, 1 byte + a scale
    # the pipeline cut (2 layers: 2 stages) compressed both ways, the TP sums plain
    assert first["pp-boundaries"] != first["none"]
    assert abs(first["pp-boundaries"] - first["none"]) < 1e-2 * first["none"]
    pp_ratio = records["pp-boundaries"]["history"][0]["comm_compression"]
    assert 1 < pp_ratio < records["taco"]["history"][0]["comm_compression"]
    assert "| TACO (default) | E4M3 G=128, Hadamard, single |" in printed and "+0.00%" in printed
    fidelity = saved["fidelity"]
    assert fidelity["steps"] == [0, 1, 2, 3, 4] and set(fidelity) == {"steps", "naive", "taco", "pp-boundaries"}
    assert all(0 < e < 0.2 for e in fidelity["taco"]["grad_error"])  # the codec's error, at the same weights
    assert "| TACO (default) |" in printed.split("at the uncompressed run's weights")[1]
    if (tmp_path / "convergence.png").exists() is False:  # matplotlib missing: the table is enough
        import importlib.util

        assert importlib.util.find_spec("matplotlib") is None
    # an existing record is reused, and --report only rebuilds the table
    assert again["taco"]["history"] == records["taco"]["history"]


def test_naive_per_tensor_reducer_is_a_pluggable_all_reduce():
    gen = torch.Generator().manual_seed(0)
    partials = [torch.randn(16, 128, generator=gen) * 1e-3 for _ in range(4)]
    partials[0][0, 0] = 1e3  # one outlier sets the per-tensor scale of rank 0
    total = torch.stack(partials).sum(0)
    group = EmulatedGroup(4, reducer=convergence.naive_per_tensor_all_reduce)
    cfg = convergence.VARIANTS["naive"].compression(128)
    naive = group.all_reduce(partials, cfg)
    taco = EmulatedGroup(4).all_reduce(partials, cfg)
    err = lambda x: float((x - total)[1:].norm() / total[1:].norm())  # noqa: E731  (rows without the outlier)
    assert err(taco) < 0.05 and err(naive) > 0.5  # per tensor, the small values flush to zero
    assert "naive_per_tensor_all_reduce" in repr(group)


def test_time_budget_stops_at_a_validation_and_runs_are_compared_at_a_common_step(tmp_path):
    argv = ["--preset", "nano", "--data", _small_text(tmp_path), "--out", str(tmp_path), "--variants", "none", "taco"]
    (stopped, _, first), (done, _, _) = run_ranks(_commands, 1, [[*argv, "--time-budget", "0"], argv], str(tmp_path))[0]
    stopped, done = stopped[0], done[0]
    for key, record in stopped.items():  # nano validates at steps 2 and 4
        saved = first[key]
        assert saved["complete"] is False and saved["steps"] == 2 and saved["history"][-1]["val_loss"] is not None
        assert record["steps"] == 2 and record["final_val"] == saved["final_val"]
    # an unfinished record is trained again, not reused; the same seed repeats its run bit for bit
    assert all(r["complete"] and r["steps"] == 4 for r in done.values())
    for key in done:
        assert [(h["loss"], h.get("val_loss")) for h in done[key]["history"][:2]] == \
            [(h["loss"], h.get("val_loss")) for h in stopped[key]["history"]]
    # a finished run next to an unfinished one: both cut at the last step both validated
    partial = dict(stopped["taco"], history=stopped["taco"]["history"][:2])
    records, step = convergence.align({"none": done["none"], "taco": partial})
    assert step == 2 and records["none"]["steps"] == 2
    assert records["none"]["final_val"] == done["none"]["history"][1]["val_loss"]
    assert convergence.align({"none": done["none"], "taco": done["taco"]}) == ({"none": done["none"], "taco": done["taco"]}, None)


def test_delta_gives_mean_range_and_standard_error_over_seeds():
    assert convergence._delta([1.01], [1.0]) == "+1.00%"
    assert convergence._delta([1.01, 0.99], [1.0, 1.0]) == "+0.00% [-1.00, +1.00]"
    # deltas +1, +2, +3 %: mean 2, sample sd 1, standard error 1 / sqrt(3)
    assert convergence._delta([1.01, 2.04, 3.09], [1.0, 2.0, 3.0]) == "+2.00% [+1.00, +3.00] s.e. 0.58"
    assert convergence._delta([float("nan"), 1.0], [1.0, 1.0]) == "-"
