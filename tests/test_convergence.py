"""Smoke test of the convergence study (``python -m taco_accel.bench.convergence``) on the nano preset."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from taco_accel.bench import convergence
from taco_accel.comm.emulated import EmulatedGroup
from taco_accel.training.loop import lr_lambda


def _small_text(tmp_path) -> str:
    """20 kB of the standard library's own source (the shipped corpus takes seconds to tokenise)."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    path = tmp_path / "text.txt"
    path.write_text(source.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return str(path)


def test_study_runs_and_reports(tmp_path, capsys):
    argv = ["--preset", "nano", "--data", _small_text(tmp_path), "--out", str(tmp_path)]
    records = convergence.main([*argv, "--variants", "none", "naive", "taco", "--fidelity"])[0]  # seed 0
    assert set(records) == {"none", "naive", "taco"}
    for key, record in records.items():
        assert record["steps"] == convergence.PRESETS["nano"].steps
        assert [h["step"] for h in record["history"] if "val_loss" in h] == [2, 4]
        assert json.loads((tmp_path / "seed0" / f"{key}.json").read_text())["final_val"] == record["final_val"]
    first = {k: r["history"][0]["loss"] for k, r in records.items()}  # same weights and batch, other codec
    assert first["taco"] != first["none"] and abs(first["taco"] - first["none"]) < 1e-2 * first["none"]
    printed = capsys.readouterr().out
    assert "| TACO (default) | E4M3 G=128, Hadamard, single |" in printed and "+0.00%" in printed
    fidelity = json.loads((tmp_path / "seed0" / "fidelity.json").read_text())
    assert fidelity["steps"] == [0, 1, 2, 3, 4] and set(fidelity) == {"steps", "naive", "taco"}
    assert all(0 < e < 0.2 for e in fidelity["taco"]["grad_error"])  # the codec's error, at the same weights
    assert "| TACO (default) |" in printed.split("at the uncompressed run's weights")[1]
    if (tmp_path / "convergence.png").exists() is False:  # matplotlib missing: the table is enough
        import importlib.util

        assert importlib.util.find_spec("matplotlib") is None
    # an existing record is reused, and --report only rebuilds the table
    again = convergence.main([*argv, "--variants", "taco", "--report"])[0]
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
    stopped = convergence.main([*argv, "--time-budget", "0"])[0]
    for key, record in stopped.items():  # nano validates at steps 2 and 4
        saved = json.loads((tmp_path / "seed0" / f"{key}.json").read_text())
        assert saved["complete"] is False and saved["steps"] == 2 and saved["history"][-1]["val_loss"] is not None
        assert record["steps"] == 2 and record["final_val"] == saved["final_val"]
    # an unfinished record is trained again, not reused
    done = convergence.main(argv)[0]
    assert all(r["complete"] and r["steps"] == 4 for r in done.values())
    # a finished run next to an unfinished one: both cut at the last step both validated
    partial = dict(stopped["taco"], history=stopped["taco"]["history"][:2])
    records, step = convergence.align({"none": done["none"], "taco": partial})
    assert step == 2 and records["none"]["steps"] == 2
    assert records["none"]["final_val"] == done["none"]["history"][1]["val_loss"]
    assert convergence.align({"none": done["none"], "taco": done["taco"]}) == ({"none": done["none"], "taco": done["taco"]}, None)


def test_train_step_follows_the_schedule_and_learning_rate_tensors_are_filled_in_place():
    """`TrainStep` is the step the study runs (eagerly off CUDA, where ``graph`` is ignored); the
    learning rate reaches AdamW as a float, or into the device tensor a captured step reads."""
    preset = convergence.PRESETS["nano"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = convergence.make_optimizer(model, preset, torch.device("cpu"))
    factor = lr_lambda(convergence.RunConfig.of(preset))  # the one loop's schedule
    assert [round(factor(s), 6) for s in (0, preset.warmup, preset.steps)] == [1 / preset.warmup, 1.0, 0.1]
    convergence.set_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    lr = torch.tensor(1.0)
    tensor_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    convergence.set_lr(tensor_opt, 0.25)
    assert tensor_opt.param_groups[0]["lr"] is lr and lr.item() == 0.25
    step = convergence.TrainStep(model, opt, torch.device("cpu"), bf16=False, graph=True)
    assert not step.graph and not step.graphed  # CUDA graphs are CUDA only


def test_delta_gives_mean_range_and_standard_error_over_seeds():
    assert convergence._delta([1.01], [1.0]) == "+1.00%"
    assert convergence._delta([1.01, 0.99], [1.0, 1.0]) == "+0.00% [-1.00, +1.00]"
    # deltas +1, +2, +3 %: mean 2, sample sd 1, standard error 1 / sqrt(3)
    assert convergence._delta([1.01, 2.04, 3.09], [1.0, 2.0, 3.0]) == "+2.00% [+1.00, +3.00] s.e. 0.58"
    assert convergence._delta([float("nan"), 1.0], [1.0, 1.0]) == "-"
