"""Fault injection, third round: damaged checkpoints named in the error itself, saves that fail
before their commit, the step a checkpoint records, sequences longer than a model's positions.

Every case ends as a clear error naming the problem and the fix, or as the right result. Real
files, FIFOs and devices; one process (the multi-rank agreement of these paths is
test_faults_io.py's).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import taco_accel
from taco_accel.errors import CheckpointError
from taco_accel.integrations import checkpoint as ckpt
from taco_accel.models.tiny import tiny_model


def _save(folder, value: float, **extra) -> None:
    ckpt.write(folder, {"x": torch.full((4,), value), "note": {"value": value}, **extra})


def _record(folder: Path) -> dict:
    return json.loads((folder / ckpt.COMMIT).read_text())


def _data_file(folder: Path) -> Path:
    return folder / next(name for name in _record(folder)["files"] if name.endswith(".distcp"))


# -- latest(): the error names each damaged checkpoint and why -----------------------------------

def _outside(folder: Path) -> str:
    record = _record(folder)
    record["files"]["../escape.bin"] = record["files"].pop(next(iter(record["files"])))
    (folder / ckpt.COMMIT).write_text(json.dumps(record))
    return "outside its data folder"


def _dev_zero(folder: Path) -> str:
    shard = _data_file(folder)
    shard.unlink()
    shard.symlink_to("/dev/zero")  # reading it would never end
    return f"{shard.name}: not a regular file"


def _fifo(folder: Path) -> str:
    shard = _data_file(folder)
    shard.unlink()
    os.mkfifo(shard)  # opening it would wait for a writer forever
    return f"{shard.name}: not a regular file"


@pytest.mark.parametrize("damage", [_outside, _dev_zero, _fifo], ids=["outside", "dev_zero", "fifo"])
def test_latest_names_each_damaged_checkpoint_and_why_in_the_error(tmp_path, damage):
    for step in (1, 2):
        _save(tmp_path / f"step_{step}", float(step))
    reasons = [damage(tmp_path / f"step_{step}") for step in (1, 2)]
    with pytest.raises(CheckpointError) as error:
        ckpt.latest(tmp_path)
    message = str(error.value)
    assert "every checkpoint" in message and "restore them from a copy" in message
    for step, reason in zip((1, 2), reasons):  # each folder with its own reason, not only in a warning
        part = message.split(f"[step_{step}] ")[1].split(" [step_")[0]
        assert str(tmp_path / f"step_{step}") in part and reason in part, message


# -- a save that fails before its commit leaves nothing behind ----------------------------------

def test_a_save_that_fails_before_its_commit_leaves_no_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="saving the checkpoint .* failed"):
        _save(tmp_path / "step_1", 1.0, unpicklable=lambda: 0)  # DCP cannot pickle it: fails while writing
    assert not (tmp_path / "step_1").exists()
    assert not ckpt.exists(tmp_path)
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError):
        _save(tmp_path / "step_2", 2.0, unpicklable=lambda: 0)
    assert sorted(p.name for p in (tmp_path / "step_2").iterdir()) == ["notes.txt"]  # the user's folder stays


def test_a_killed_saves_folder_without_a_commit_record_does_not_count(tmp_path):
    (tmp_path / "step_3" / "taco_state-0123456789abcdef").mkdir(parents=True)  # killed before its commit
    assert not ckpt.exists(tmp_path)
    _save(tmp_path / "step_1", 1.0)
    assert ckpt.exists(tmp_path)


# -- the step a checkpoint records ---------------------------------------------------------------

def test_the_commit_record_holds_the_training_step(tmp_path, caplog):
    acc = taco_accel.Accelerator(compression=None)
    model = tiny_model("qwen2")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # three optimizer steps, never inside accelerator.accumulate (its counter stays 0)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(tmp_path / "step_3")
    assert _record(tmp_path / "step_3")["step"] == 3
    opt.steps = 0
    with caplog.at_level(logging.INFO, logger="taco_accel.integrations.checkpoint.state"):
        acc.load_state(tmp_path / "step_3")
    assert "(saved at step 3 on mesh" in caplog.text and opt.steps == 3  # the count resumes too


# -- GPT-2 beyond its learned positions ----------------------------------------------------------

@pytest.mark.parametrize("emulate", [False, True], ids=["tp1", "emulated_tp2"])
def test_gpt2_beyond_n_positions_names_the_limit(emulate):
    ranks = dict(tp=2, emulate=True) if emulate else dict(tp=1)  # emulated TP checks its inputs as real TP does
    model = taco_accel.parallelize(tiny_model("gpt2"), compression=None, **ranks)
    limit = model.config.n_positions
    model(torch.zeros(1, limit, dtype=torch.long))  # exactly the limit: fine
    with pytest.raises(IndexError, match=rf"position {limit} is out of range: the model has {limit} learned "
                                         rf"positions .* truncate the inputs \(tokenizer max_length={limit}\)"):
        model(torch.zeros(1, limit + 1, dtype=torch.long))
