"""Fault injection, second round: files, paths, hangs, silent resumes, command lines.

Every case ends as a clear error naming the problem and the fix, on every rank, in bounded
time, or as the right result. Real files, FIFOs, symlinks and planted pickles; gloo processes
(`run_ranks`) where ranks must agree. One 2-rank launch runs the multi-rank cases (each case
returns its own outcome, so each test fails on its own); each killed save is a launch of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import taco_accel
from taco_accel.errors import CheckpointError, ConfigError, DataError, OutputExistsError
from taco_accel.integrations import checkpoint as ckpt
from taco_accel.models.tiny import tiny_model

FAST_S = 120  # a launch that takes longer hangs somewhere


def _outcome(call) -> dict:
    """``{"type", "message", "value"}`` of ``call()``: what it raised, or what it returned."""
    try:
        return {"type": None, "message": "", "value": call()}
    except Exception as error:  # noqa: BLE001 - the test asserts on the type
        return {"type": type(error).__name__, "message": str(error), "value": None}


def _values(folder) -> float:
    """The value of the one tensor ``x`` a test checkpoint holds (read in this process)."""
    _, reader, _ = ckpt.open_checkpoint(folder)
    return ckpt.read(reader, {"x": torch.zeros(4)})["x"][0].item()


def _save(folder, value: float, **extra) -> None:
    ckpt.write(folder, {"x": torch.full((4,), value), "note": {"value": value}, **extra})


# -- saves touch only their own folder and temporaries ------------------------------------------

def test_a_save_keeps_the_users_files_and_the_siblings(tmp_path):
    run = tmp_path / "runs" / "ckpt"
    run.mkdir(parents=True)
    mine = {"notes.txt": "my notes", "meta.json": '{"mine": true}', "sub/data.bin": "x"}
    for name, text in mine.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    siblings = [tmp_path / "runs" / ".ckpt.backup-1", tmp_path / "runs" / ".ckpt.tmp-0123abcd"]
    for sibling in siblings:
        sibling.mkdir()
        (sibling / "keep").write_text("keep")
    for value in (1.0, 2.0):
        _save(run, value)
    assert {name: (run / name).read_text() for name in mine} == mine
    assert all((sibling / "keep").read_text() == "keep" for sibling in siblings)
    assert len([p for p in run.iterdir() if p.name.startswith("taco_state-")]) == 1  # the replaced one is gone
    assert _values(run) == 2.0


def test_a_concurrent_writers_temporary_is_left_alone(tmp_path):
    import fcntl

    _save(tmp_path, 1.0)
    other = tmp_path / "taco_state-0123456789abcdef"  # another job's save, in progress
    other.mkdir()
    (other / "__0_0.distcp").write_bytes(b"half written")
    with open(other / ckpt.LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _save(tmp_path, 2.0)
        assert (other / "__0_0.distcp").exists()
    _save(tmp_path, 3.0)  # its writer is gone (the lock is free): a leftover, deleted
    assert not other.exists() and _values(tmp_path) == 3.0


# -- damaged, planted and escaping checkpoints ---------------------------------------------------

def _steps(root: Path) -> None:
    for step in (1, 2):
        _save(root / f"step_{step}", float(step))


def _data_file(folder: Path) -> Path:
    record = json.loads((folder / ckpt.COMMIT).read_text())
    return folder / next(name for name in record["files"] if name.endswith(".distcp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "fifo", "dev_zero", "symlink"])
def test_a_damaged_latest_is_skipped_for_the_one_before(tmp_path, caplog, damage):
    _steps(tmp_path)
    shard = _data_file(tmp_path / "step_2")
    data = bytearray(shard.read_bytes())
    shard.unlink()
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-100]))
    elif damage == "fifo":
        os.mkfifo(shard)  # opening it would wait for a writer forever
    elif damage == "dev_zero":
        shard.symlink_to("/dev/zero")  # reading it would never end
    elif damage == "symlink":
        (tmp_path / "elsewhere.bin").write_bytes(bytes(data))  # the right bytes, outside the folder
        shard.symlink_to(tmp_path / "elsewhere.bin")
    with caplog.at_level("WARNING"):
        assert _returns(lambda: ckpt.latest(tmp_path)) == tmp_path / "step_1"
    assert "step_2" in caplog.text and shard.name in caplog.text  # the warning names the file
    with pytest.raises(CheckpointError, match=rf"{shard.name}: "):
        ckpt.verify(tmp_path / "step_2")


def _bounded(call, limit_s: float = FAST_S) -> dict:
    """`_outcome` of ``call()``, run in a daemon thread: a call that blocks (a FIFO opened, a
    device read) fails the test instead of hanging it."""
    import threading

    box = {}
    thread = threading.Thread(target=lambda: box.update(outcome=_outcome(call)), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), "blocked (a FIFO opened, or a device read)"
    return box["outcome"]


def _returns(call):
    outcome = _bounded(call)
    assert outcome["type"] is None, outcome
    return outcome["value"]


def _raises(call, kind: str, pattern: str) -> None:
    import re

    outcome = _bounded(call)
    assert outcome["type"] == kind and re.search(pattern, outcome["message"]), outcome


def _edit_record(folder: Path, **changes) -> None:
    record = json.loads((folder / ckpt.COMMIT).read_text())
    record.update(changes)
    (folder / ckpt.COMMIT).write_text(json.dumps(record))


@pytest.mark.parametrize("name", ["../../outside.bin", "taco_state-0123456789abcdef/../../outside.bin",
                                  "/dev/zero", "{data}/sub/x.bin", "{data}/.lock"])
def test_a_record_naming_files_outside_its_data_folder_is_refused(tmp_path, name):
    folder = tmp_path / "deep" / "ckpt"
    _save(folder, 1.0)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")  # a real file with its true size and checksum: refused by name
    record = json.loads((folder / ckpt.COMMIT).read_text())
    files = {**record["files"], name.format(data=record["data"]): ckpt.describe(outside)}
    _edit_record(folder, files=files)
    with pytest.raises(CheckpointError, match=r"outside its data folder .*\(planted or edited record\)"):
        ckpt.verify(folder)


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch planted_code_ran",))


def _replan(folder: Path) -> None:
    """Rewrite the record so that every file's size and checksum match again (an attacker's edit)."""
    record = json.loads((folder / ckpt.COMMIT).read_text())
    _edit_record(folder, files={name: ckpt.describe(folder / name) for name in record["files"]})


def test_planted_pickles_run_no_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    entry = tmp_path / "entry"
    _save(entry, 1.0, planted={"payload": _Planted()})  # a value only a pickle can hold
    _replan(entry)
    _, reader, _ = ckpt.open_checkpoint(entry)
    with pytest.raises(CheckpointError, match=r"'planted' refused by torch.load\(weights_only=True\)"):
        ckpt.read(reader, {"x": torch.zeros(4), "planted": None})
    metadata = tmp_path / "metadata"
    _save(metadata, 1.0)
    record = json.loads((metadata / ckpt.COMMIT).read_text())
    (metadata / record["data"] / ".metadata").write_bytes(pickle.dumps(_Planted()))
    _replan(metadata)
    with pytest.raises(CheckpointError, match=r"\.metadata: DCP metadata refers to (posix|os|nt)\.system, .*\(planted file\)"):
        ckpt.open_checkpoint(metadata)
    assert not (tmp_path / "planted_code_ran").exists()


def test_dcp_metadata_pointing_outside_the_record_is_refused(tmp_path):
    _save(tmp_path, 1.0)
    record = json.loads((tmp_path / ckpt.COMMIT).read_text())
    path = tmp_path / record["data"] / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file: a plain unpickle is fine here
    metadata.storage_data = {index: dataclasses.replace(info, relative_path="../../outside.bin")
                             for index, info in metadata.storage_data.items()}
    path.write_bytes(pickle.dumps(metadata))
    _replan(tmp_path)
    with pytest.raises(CheckpointError, match=r"points at \['../../outside.bin'\], which .* does not list"):
        ckpt.open_checkpoint(tmp_path)


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"taco_checkpoint.json is not valid JSON \(.* line \d+, column \d+\): truncated or edited; "
                 r"resume from an earlier checkpoint"),
    ("nested", r"taco_checkpoint.json is nested too deeply"),
    ("fifo", r"not a regular file"),
    ("missing", r"holds no complete checkpoint \(no taco_checkpoint.json\)"),
    ("old_format", r"written by an older taco_accel \(checkpoint format 1\)"),
], ids=["truncate", "nested", "fifo", "missing", "old_format"])
def test_a_bad_commit_record_is_a_clear_error(tmp_path, damage, message):
    _save(tmp_path, 1.0)
    path = tmp_path / ckpt.COMMIT
    text = path.read_text()
    path.unlink()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "old_format":
        (tmp_path / "meta.json").write_text(json.dumps({"format": "taco_accel-checkpoint", "version": 1}))
    _raises(lambda: ckpt.verify(tmp_path), "CheckpointError", message)


# -- data files and caches -----------------------------------------------------------------------

@pytest.mark.parametrize("case,message", [
    ("binary.txt", r"binary.txt: a binary file \(NUL byte at 3\), not text"),
    ("latin1.txt", r"latin1.txt: not UTF-8 text \(byte 3"),
    ("folder_with_weights", r"model.safetensors: a binary file"),
    ("corrupt.parquet", r"corrupt.parquet: not a readable parquet file"),
    ("nested.json", r"nested.json: JSON nested too deeply"),
    ("nested.jsonl", r"nested.jsonl:2: JSON nested too deeply"),
], ids=["binary", "latin1", "folder_with_weights", "corrupt_parquet", "nested_json", "nested_jsonl"])
def test_unreadable_data_files_name_the_file(tmp_path, case, message):
    from taco_accel.data import load_texts

    path = tmp_path / case
    if case == "binary.txt":
        path.write_bytes(b"abc\x00\x01\x02 text")
    elif case == "latin1.txt":
        path.write_bytes("caf\u00e9 na\u00efve".encode("latin-1"))
    elif case == "folder_with_weights":
        path.mkdir()
        (path / "train.txt").write_text("some text " * 20)
        (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      \x00\x01")
    elif case == "corrupt.parquet":
        path.write_bytes(b"PAR1" + b"\x00" * 64)
    elif case == "nested.json":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DataError, match=message):
        load_texts(str(path))


def test_a_damaged_or_planted_token_cache_is_made_again(tmp_path, monkeypatch, caplog):
    from taco_accel.data import build_tokenizer, tokenize

    monkeypatch.chdir(tmp_path)
    tok, docs = build_tokenizer("byte"), ["hello world", "second document"]
    expected = tokenize(docs, tok)
    cache = tmp_path / "cache"
    tokenize(docs, tok, cache)
    (path,) = cache.glob("tokens-*.pt")
    path.write_bytes(path.read_bytes()[:50])  # a truncated write
    with caplog.at_level("WARNING"):
        assert torch.equal(tokenize(docs, tok, cache), expected)
    assert "the token cache" in caplog.text and "is damaged" in caplog.text and "tokenizing the text again" in caplog.text
    torch.save({"payload": _Planted()}, path)  # someone else's file under the cache's name
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert torch.equal(tokenize(docs, tok, cache), expected)
    assert not (tmp_path / "planted_code_ran").exists()


# -- from_pretrained reads its own folder only ---------------------------------------------------

@pytest.mark.parametrize("case", ["index_escape", "weights_fifo", "config_fifo"])
def test_from_pretrained_reads_only_its_folder(tmp_path, case):
    from safetensors import safe_open

    folder = tmp_path / "model"
    tiny_model("qwen2").save_pretrained(folder)
    if case == "index_escape":
        (tmp_path / "elsewhere").mkdir()
        os.replace(folder / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
        with safe_open(str(tmp_path / "elsewhere" / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": {n: "../elsewhere/model.safetensors" for n in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        message = r"maps .* to '../elsewhere/model.safetensors', outside .*its own folder only"
    else:
        target = folder / ("model.safetensors" if case == "weights_fifo" else "config.json")
        target.unlink()
        os.mkfifo(target)
        message = r"is not a regular file \(a FIFO"
    _raises(lambda: taco_accel.from_pretrained(folder, compression=None), "CheckpointError", message)


# -- what parallelize and the step take ----------------------------------------------------------

def _scale(module, args, output):
    return output * 2


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "instance_forward"])
def test_hooks_on_a_swapped_linear_are_refused(kind):
    model = tiny_model("llama")
    target = model.model.layers[1].mlp.down_proj
    if kind == "forward_hook":
        target.register_forward_hook(_scale)
        message = r"down_proj has forward hooks \(_scale\); parallelize replaces this module .* Register them after"
    elif kind == "forward_pre_hook":
        target.register_forward_pre_hook(lambda module, args: None)
        message = r"down_proj has forward pre-hooks"
    else:
        target.forward = lambda x: nn.Linear.forward(target, x)
        message = r"down_proj has a forward of its own"
    with pytest.raises(ValueError, match=message):
        taco_accel.parallelize(model, compression=None)
    model = tiny_model("llama")
    model.model.layers[1].register_forward_hook(lambda m, a, o: None)  # not swapped: kept, accepted
    taco_accel.parallelize(model, compression=None)


def test_forward_hooks_of_the_token_embedding_move_to_its_parallel_layer():
    """The embedding's replacement returns the same full embedding, so its forward hooks (peft's
    and transformers' enable_input_require_grads among them) keep working and keep their handles."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    model.load_state_dict(ref.state_dict())
    seen = []
    handle = model.model.embed_tokens.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    model.enable_input_require_grads()  # transformers' own forward hook on the input embeddings
    taco_accel.parallelize(model, tp=2, compression=None, emulate=True)
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits = ref(ids).logits
    model.requires_grad_(False)  # frozen, as under LoRA: only the hook makes the output need grad
    out = model(ids)
    assert seen == [torch.Size([2, 8, ref.config.hidden_size])]  # the full embedding, as before
    assert out.logits.requires_grad  # the require-grads hook fired on the new layer
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=1e-5)  # fp32 rounding of tp=2 sums
    handle.remove()
    model(ids)
    assert len(seen) == 1  # the handle removed the hook from the new layer


def test_a_model_on_the_meta_device_says_to_load_weights(tmp_path):
    with torch.device("meta"):
        model = tiny_model("qwen2")
    taco_accel.parallelize(model, compression=None)
    with pytest.raises(ValueError, match=r"parameters are on the meta device.*taco_accel.from_pretrained"):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight is on the meta device .* load or initialise"):
        taco_accel.save_pretrained(model, tmp_path)


@pytest.mark.parametrize("max_norm,kind", [(float("nan"), ValueError), (-1.0, ValueError), ("1.0", TypeError),
                                           (None, TypeError)])
def test_clip_grad_norm_refuses_what_cannot_clip(max_norm, kind):
    from taco_accel.parallel import clip_grad_norm_

    with pytest.raises(kind, match="max_norm="):
        clip_grad_norm_([], [], max_norm)


@pytest.mark.parametrize("name,value", [("TACO_PP_SIZE", "two"), ("PARALLELISM_CONFIG_TP_SIZE", "2.0"),
                                        ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1e400"), ("TACO_PP_SIZE", "0")])
def test_mesh_sizes_from_the_environment_name_the_variable(monkeypatch, name, value):
    from taco_accel.parallel import ParallelDims

    monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    with pytest.raises(ConfigError, match=rf"{name}='{value}' is not a whole number >= 1: set it .* or unset it"):
        ParallelDims.from_env(2)


def test_a_bad_flag_is_one_line_and_status_2(capsys):
    from taco_accel.training.cli import build_parser

    for argv, message in ((["--compression", "maybe"], "--compression: 'maybe': use auto, on, off or a JSON "
                           "settings file"), (["--data", "missing.jsonl"], "--data: 'missing.jsonl': no such file")):
        with pytest.raises(SystemExit) as exit_:
            build_parser("qwen2", "test").parse_args(argv)
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert ": error: argument " in last and message in last, last


# -- several ranks: identity of checkpoints, batches, models, command lines, runs ----------------

def _run(out: str, **changes):
    from taco_accel.training import TrainConfig, Trainer

    values = dict(family="qwen2", preset="nano", seq_len=32, micro_batch_size=2, micro_batches=1, steps=2, lr=1e-2,
                  warmup_steps=0, eval_every=0, trackers=(), progress=False, export=False, plot=False,
                  compression=None, output_dir=out, device="cpu", tp=2, save_every=1)
    return Trainer(TrainConfig(**(values | changes)))


def _cli(argv: list[str], error_file: str) -> dict:
    from taco_accel.training import cli

    os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
    err = io.StringIO()
    code = None
    with contextlib.redirect_stderr(err):
        try:
            cli.main("qwen2", "pretrain", argv)
        except SystemExit as e:
            code = e.code
    recorded = Path(error_file).read_text() if os.path.exists(error_file) else None
    return {"code": code, "stderr": err.getvalue(), "recorded": recorded}


def _ranks(root: str, data: str) -> dict:
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    root_path = Path(root)
    out = {}
    # two saves of the same shapes; each rank names its own
    for r in range(2):
        _save(root_path / f"run{r}", float(r))  # a collective
    out["two_runs"] = _outcome(lambda: ckpt.verify(root_path / f"run{rank}"))
    # a save that fails on one rank (no space left): every rank hears, the old checkpoint stays
    real_save = torch.save

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.save = full_disk if rank == 1 else real_save
    try:
        out["enospc"] = _outcome(lambda: _save(root_path / "run0", 5.0))
    finally:
        torch.save = real_save
    real_replace = os.replace  # the commit record's rename, on rank 0: the disk fills up at the last moment
    os.replace = (lambda *a, **k: full_disk()) if rank == 0 else real_replace
    try:
        out["enospc_commit"] = _outcome(lambda: _save(root_path / "run0", 6.0))
    finally:
        os.replace = real_replace
    out["enospc_after"] = _outcome(lambda: (_values(root_path / "run0"),
                                            sorted(p.name for p in (root_path / "run0").iterdir())))
    # the same model built on every rank from a config that save_pretrained marked on rank 0 only
    model = tiny_model("qwen2")
    if rank == 0:
        model.save_pretrained(root_path / "saved")  # sets config.architectures here only
    dist.barrier()
    torch.manual_seed(0)
    out["same_model"] = _outcome(lambda: type(taco_accel.parallelize(AutoModelForCausalLM.from_config(model.config),
                                                                     compression=None)).__name__)
    # later batches of other shapes: one exchange per new (batch, sequence) shape; every forward's
    # with TACO_CHECK_COLLECTIVES=1
    model = taco_accel.parallelize(tiny_model("qwen2"), compression=None)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids)
    out["same_shape"] = _outcome(lambda: _shape_exchanges(model, [ids, ids, ids[:, :7], ids[:, :7]]))
    with _every_forward_checked():
        out["every_forward"] = _outcome(lambda: _shape_exchanges(model, [ids, ids]))
    out["other_shape"] = _outcome(lambda: model(ids[:, : 6 - rank]))  # new on both ranks
    with _every_forward_checked():
        out["seen_and_new"] = _outcome(lambda: model(ids[:, : 8 - 2 * rank]))  # agreed on rank 0, new on rank 1
    out["after"] = _outcome(lambda: model(ids).logits.shape[-1])  # the group still works
    # a byte-tokenizer run resumed with a BPE tokenizer of the same padded vocabulary (384)
    _run(f"{root}/tok", data=data).train()
    out["tokenizer"] = _outcome(lambda: _run(f"{root}/tok", data=data, tokenizer="bpe:300",
                                             resume=f"{root}/tok/checkpoints/step_1"))
    out["rerun"] = _outcome(lambda: _run(f"{root}/tok", data=data).train())
    # Accelerate's save_state / load_state contracts, with the user's own files in the folder
    out["accelerate"] = _outcome(lambda: _accelerate_contracts(root_path / "myrun"))
    out["wire"] = _wire_error(f"{root}/wire", data)
    # command lines (last: the error ends the process group, as it ends the process)
    error_file = f"{root}/error{rank}.json"
    out["cli_tp"] = _cli(["--preset", "nano", "--tp", "3", "--output-dir", f"{root}/cli", "--trackers", "none"],
                         error_file)
    out["cli_compression"] = _cli(["--compression", "maybe"], error_file + "b")
    out["cli_data"] = _cli(["--data", f"{root}/missing.jsonl"], error_file + "c")
    return out


def _wire_error(out: str, data: str) -> dict:
    """The recipes' loop, compressed, whose collectives meet a chunk of another config at step 3
    (rank 1 changes a forward site's format: the wire size stays; the header reads deferred as on
    a GPU, `codec.api.READ_AT_ONCE` emptied as TACO_DEFER_HEADER_READS=1 does): where it stops."""
    from taco_accel.codec import api

    trainer = _run(out, data=data, steps=4, save_every=0, compression=taco_accel.TacoConfig(group_size=32))
    step = trainer.train_step

    def drifting() -> dict:
        if trainer.step == 2 and dist.get_rank() == 1:
            sites = next(t for t in trainer.parts.site_tables() if "layers.0.mlp.down_proj/fwd" in t)
            site = sites["layers.0.mlp.down_proj/fwd"]
            site.config = site.config.replace(format="e5m2")
        return step()

    trainer.train_step = drifting
    saved, api.READ_AT_ONCE = api.READ_AT_ONCE, ()
    try:
        got = _outcome(trainer.train)
    finally:
        api.READ_AT_ONCE = saved
    weight = next(trainer.parts.parameters())
    return {**got, "step": trainer.step, "rows": len(trainer.history), "finite_weights": bool(weight.isfinite().all())}


def _shape_exchanges(model, batches: list) -> list[int]:
    """How many all-gathers (the input checks' collective: the TP layers call the process group
    itself) each forward of ``batches`` ran."""
    real, counts = dist.all_gather, []

    def counted(*args, **kwargs):
        counts[-1] += 1
        return real(*args, **kwargs)

    dist.all_gather = counted
    try:
        for ids in batches:
            counts.append(0)
            model(ids)
    finally:
        dist.all_gather = real
    return counts


@contextlib.contextmanager
def _every_forward_checked():
    """``TACO_CHECK_COLLECTIVES=1`` inside (on every rank alike: the setting is part of the ranks' agreement)."""
    from taco_accel.comm import agreement

    saved = os.environ.get(agreement.DEBUG_ENV)
    os.environ[agreement.DEBUG_ENV] = "1"
    agreement.debug.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(agreement.DEBUG_ENV) if saved is None else os.environ.update({agreement.DEBUG_ENV: saved})
        agreement.debug.cache_clear()


def _accelerate_contracts(folder: Path) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    acc = taco_accel.Accelerator(compression=None)
    model = tiny_model("qwen2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(TensorDataset(torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(1))),
                      batch_size=2)
    model, opt, data = acc.prepare(model, opt, data)
    (ids,) = next(iter(data))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    dist.barrier()
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), sorted(weights[0])[:1], output_dir))
        weights[0].pop("lm_head.weight")  # saved by the hook itself, as diffusers does with whole models

    def load_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))

    handles = [acc.register_save_state_pre_hook(save_hook), acc.register_load_state_pre_hook(load_hook)]
    try:
        acc.save_state(folder, safe_serialization="yes")
        bad_flag = None
    except TypeError as e:
        bad_flag = str(e)
    acc.save_state(folder, safe_serialization=False)
    acc.save_state(folder)
    missing = None
    try:
        acc.load_state(folder)
    except CheckpointError as e:
        missing = str(e)  # lm_head.weight was left to the save hook: Accelerate's load fails the same way
    lenient = _outcome(lambda: acc.load_state(folder, strict=False))  # as Accelerate: the rest is loaded
    for handle in handles:
        handle.remove()
    acc.save_state(folder)
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(folder)
    restored = all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
    config = acc.project_configuration  # automatic naming: project_dir/checkpoints/checkpoint_<i>, total_limit kept
    config.set_directories(str(folder / "auto"))
    config.automatic_checkpoint_naming, config.total_limit, config.iteration = True, 2, 0
    named = [acc.save_state().name for _ in range(3)]
    kept = sorted(p.name for p in (folder / "auto" / "checkpoints").iterdir())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state()  # the newest
    resumed = all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
    return {"notes": (folder / "notes.txt").read_text(), "calls": calls, "bad_flag": bad_flag, "missing": missing,
            "lenient": lenient["type"], "restored": restored, "named": named, "kept": kept, "resumed": resumed}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    data = root / "text.txt"
    data.write_text((open(os.path.join(os.path.dirname(torch.__file__), "functional.py")).read())[:20_000])
    return run_ranks(_ranks, 2, str(root), str(data), timeout=FAST_S)


def _every_rank(ranks, case, kind, *fragments) -> list:
    for rank, result in enumerate(ranks):
        got = result[case]
        assert got["type"] == kind, (rank, got)
        assert all(f in got["message"] for f in fragments), (rank, got["message"])
    return [r[case]["value"] for r in ranks]


def test_ranks_that_name_different_checkpoints_raise_on_every_rank(ranks):
    _every_rank(ranks, "two_runs", "CheckpointError", "would resume from different checkpoints", "rank 0:",
                "rank 1:", "pass the same folder")


def test_a_full_disk_on_one_rank_fails_the_save_everywhere_and_keeps_the_old_one(ranks):
    _every_rank(ranks, "enospc", "CheckpointError", "rank 1: no space left on the device", "is unchanged")
    _every_rank(ranks, "enospc_commit", "CheckpointError", "committing the checkpoint", "no space left on the device")
    value, files = _every_rank(ranks, "enospc_after", None)[0]
    assert value == 0.0 and len([f for f in files if f.startswith("taco_state-")]) == 1  # no leftover


def test_a_config_marked_by_save_pretrained_on_one_rank_is_the_same_model(ranks):
    _every_rank(ranks, "same_model", None)


def test_a_batch_of_another_shape_on_one_rank_raises_on_every_rank(ranks):
    # one all-gather for each (batch, sequence) shape not seen before, none for one agreed already
    assert _every_rank(ranks, "same_shape", None) == [[0, 0, 1, 0]] * 2
    assert _every_rank(ranks, "every_forward", None) == [[1, 1]] * 2  # TACO_CHECK_COLLECTIVES=1
    _every_rank(ranks, "other_shape", "ValueError", "input_ids of different shapes ([[2, 6], [2, 5]]",
                "same batch size and sequence length")
    # rank 0's shape agreed before, rank 1's new: the check of every forward sees it
    _every_rank(ranks, "seen_and_new", "ValueError", "input_ids of different shapes ([[2, 8], [2, 6]]")
    assert _every_rank(ranks, "after", None) == [128, 128]


def test_a_wire_error_stops_the_recipes_loop_before_its_optimizer_step(ranks):
    # the step's one host read (loss, figures, gradient norm) carries the wire check: step 3's
    # optimizer step never runs, the weights stay finite
    for rank, got in enumerate(r["wire"] for r in ranks):
        assert got["type"] == "WireFormatError" and got["step"] == got["rows"] == 2, (rank, got)
        assert got["message"].startswith("layers.0.mlp.down_proj/fwd: ") and got["finite_weights"], (rank, got)


def test_resuming_with_another_tokenizer_of_the_same_vocabulary_size_is_refused(ranks):
    _every_rank(ranks, "tokenizer", "CheckpointError", "trained with the tokenizer 'byte'", "this run has 'bpe:300'",
                "Resume with --tokenizer byte")


def test_a_new_run_into_a_previous_runs_folder_is_refused(ranks):
    _every_rank(ranks, "rerun", "OutputExistsError", "history.jsonl", "checkpoints", "--resume latest",
                "another --output-dir")


def test_save_state_keeps_the_users_files_and_runs_accelerates_hooks(ranks):
    for r in _every_rank(ranks, "accelerate", None):
        assert r["notes"] == "mine"
        assert r["bad_flag"] == "safe_serialization='yes': pass True or False"
        assert [c[0] for c in r["calls"]] == ["save", "save", "load", "load"] and r["calls"][0][1] == 1
        assert r["missing"] is not None and "lm_head.weight" in r["missing"] and r["lenient"] is None
        assert r["restored"]
        assert r["named"] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"], r  # automatic naming
        assert r["kept"] == ["checkpoint_1", "checkpoint_2"] and r["resumed"], r  # total_limit=2; the newest loaded


@pytest.mark.parametrize("case,message", [
    ("cli_tp", "tp=3 does not divide the world size 2"),
    ("cli_compression", "argument --compression: 'maybe': use auto, on, off or a JSON settings file"),
    ("cli_data", "missing.jsonl': no such file or folder"),
], ids=["tp_3_on_2", "compression_maybe", "missing_data"])
def test_a_command_line_error_is_one_line_once_with_status_2(ranks, case, message):
    first, other = ranks[0][case], ranks[1][case]
    assert first["code"] == 2 and other["code"] == 2
    lines = first["stderr"].strip().splitlines()
    assert ": error: " in lines[-1] and message in lines[-1], first["stderr"]
    assert "Traceback" not in first["stderr"] and other["stderr"] == ""  # once: rank 0 alone prints
    assert message in json.loads(first["recorded"])["message"]["extraInfo"]["py_callstack"]
    assert other["recorded"] is None


# -- killed saves: the old checkpoint or the new one, whole ----------------------------------------

def _saves_then_dies(root: str, where: str) -> None:
    """Save ``step_1`` (values 1), then save it again (values 2) and die with SIGKILL: rank 1
    while writing its data (``"write"``), rank 0 just before committing the record
    (``"commit"``) or just after, before deleting the old data (``"cleanup"``)."""
    import signal
    import shutil

    rank = dist.get_rank()
    folder = os.path.join(root, "step_1")
    ckpt.write(folder, {f"x{rank}": torch.full((4,), 1.0)})

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1 and where == "write":
        torch.save = die
    if rank == 0 and where == "commit":
        os.replace = die
    if rank == 0 and where == "cleanup":
        shutil.rmtree = die
    ckpt.write(folder, {f"x{rank}": torch.full((4,), 2.0)})


@pytest.mark.parametrize("where,expect", [("write", 1.0), ("commit", 1.0), ("cleanup", 2.0)])
def test_a_killed_save_never_mixes_two_saves(tmp_path, where, expect):
    with pytest.raises(AssertionError, match=r"rank\(s\) failed"):  # the killed rank, or its peer left alone
        run_ranks(_saves_then_dies, 2, str(tmp_path), where, timeout=FAST_S)
    folder = ckpt.latest(tmp_path)  # no torch.distributed here: a look at the run's folder
    _, reader, _ = ckpt.open_checkpoint(folder)
    values = ckpt.read(reader, {"x0": torch.zeros(4), "x1": torch.zeros(4)})
    assert {values["x0"][0].item(), values["x1"][0].item()} == {expect}  # never one of each
    ckpt.write(folder, {"x0": torch.zeros(4), "x1": torch.zeros(4)})  # a later save cleans up the dead one's data
    assert len([p for p in folder.iterdir() if p.name.startswith("taco_state-")]) == 1
